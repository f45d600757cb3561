"""A local fleet of real processes — Redis, an S3 server behind a proxy that can be cut, control
and GPU workers with emulator engines — for the tests and the benches alike.

Nothing here is shipped: the wheel holds `genfleet.*` alone. Tests keep their fixtures, fakes
and test-only helpers in `tests/`; nothing outside `tests/` imports `tests`.
"""
