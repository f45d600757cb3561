"""Fixtures of the common package's tests (the Redis database twice, `db`, is the root's)."""
