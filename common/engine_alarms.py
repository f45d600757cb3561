"""Engines that need a person, as their workers publish them: the one owner of the key.

A worker writes its entry when its engine's restart budget is spent (a cool-down, not taking
work) or when the engine dies the same way on every restart (a crash loop, with the error and
any known workaround), and clears it when the engine serves again or the worker stops. A
worker killed outright cannot clear its own: the pruning of silent workers' pushed summaries
(workers/observe/pushed.py) forgets theirs in the same transaction, so a dead worker's alarm
is not shown by `status` forever. One Redis hash (`keys.engine_alarms_key`) worker → JSON,
no TTL; only this module touches it (tests/test_key_owners.py holds it so).
"""

from __future__ import annotations

from collections.abc import Collection
from typing import Any

import orjson
import redis

from genfleet.common import keys
from genfleet.common.redis_conn import text


def publish(client: redis.Redis, worker: str, alarm: dict[str, Any] | None) -> None:
    """`worker`'s engine needs a person (`alarm`), or no longer does (None)."""
    if alarm is None:
        client.hdel(keys.engine_alarms_key(), worker)
    else:
        client.hset(keys.engine_alarms_key(), worker, orjson.dumps(alarm))


def forget(pipe: redis.Redis, workers: Collection[str]) -> None:
    """Queue, in the pipeline of the pass that forgets silent workers: their alarms go too."""
    if workers:
        pipe.hdel(keys.engine_alarms_key(), *workers)


def of_queue(client: redis.Redis, queue: str) -> list[dict[str, Any]]:
    """The alarms of `queue`'s workers, each with its worker's name; entries that are not
    JSON objects are skipped."""
    alarms = []
    for worker, raw in sorted(client.hgetall(keys.engine_alarms_key()).items()):
        try:
            alarm = orjson.loads(raw)
        except orjson.JSONDecodeError:
            continue
        if isinstance(alarm, dict) and alarm.get("queue") == queue:
            alarms.append({**alarm, "worker": text(worker)})
    return alarms
