"""The fleet registry: every worker the power-watch heard lately, with when it last did.

A worker that stops pushing its summary is a finding only if someone still expects it. The
power-watch beat (workers/observe/power_watch.py) stamps each worker whose summary it read
with its own clock and forgets those it has not heard for its forget window; the pruning of
the pushed summaries (workers/observe/pushed.py) forgets the workers it prunes in the same
transaction. `status` reads it to say which workers answer when a run stalls
(producer/status.py). One Redis hash (`keys.workers_key`) worker → time, no TTL; this module
is the only code that touches it (tests/test_key_owners.py holds it so).
"""

from __future__ import annotations

from collections.abc import Collection

import redis

from genfleet.common import keys
from genfleet.common.redis_conn import text


def heard(pipe: redis.Redis, workers: Collection[str], now: float) -> None:
    """Queue, in the power-watch's pipeline: `workers` answered at `now` (the beat's clock)."""
    if workers:
        pipe.hset(keys.workers_key(), mapping={worker: now for worker in workers})


def forget(pipe: redis.Redis, workers: Collection[str]) -> None:
    """Queue, in the pipeline of the pass that drops them (the power-watch past its forget
    window, the pruning of pushed summaries): `workers` are no longer expected."""
    if workers:
        pipe.hdel(keys.workers_key(), *workers)


def seen(client: redis.Redis) -> dict[str, float]:
    """Worker → when it was last heard (one HGETALL)."""
    return {text(k): float(v) for k, v in client.hgetall(keys.workers_key()).items()}
