"""The runs registry: the names of the runs this Redis serves, for the passes over all runs.

The store lists every run (`genfleet runs` reads its folders); the fleet's own passes (the
power-watch's pending work, the tok/s of `top`, the lost-order reconciler, the progress
repair) need the few runs that are live now without listing the store each beat. So
`enqueue` registers a run before it sends its first order (again on every resume or retry),
and a run leaves the set when the progress repair finds it complete, nothing queued and not
staging, or when `delete` removes it: a registry that only grew would cost every pass more
each week. One Redis set (`keys.runs_key`), no TTL; this module is the only code that
touches it (tests/test_key_owners.py holds it so).
"""

from __future__ import annotations

import redis

from genfleet.common import keys
from genfleet.common.redis_conn import text


def register(client: redis.Redis, run: str) -> None:
    """Called by `enqueue` (and so by a resume or a retry) before any order of `run` is
    sent: the fleet's passes see the run from its first order on."""
    client.sadd(keys.runs_key(), run)


def retire(client: redis.Redis, run: str) -> int:
    """Called by the progress repair for a complete run and by `delete`: the passes stop
    looking at `run`. Returns 1 if it was registered, else 0."""
    return int(client.srem(keys.runs_key(), run))


def runs(client: redis.Redis) -> list[str]:
    """The registered runs, sorted (one SMEMBERS)."""
    return sorted(text(member) for member in client.smembers(keys.runs_key()))
