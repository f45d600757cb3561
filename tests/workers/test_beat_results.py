"""The beat tasks' results expire within the hour (BEAT_RESULT_EXPIRES_S), not after the week
a batch's result is kept: a round a minute for a 16-day run must not pile up in Redis."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import orjson
import pytest
import redis

from genfleet.common.celery_config import (
    BEAT_RESULT_EXPIRES_S,
    POWER_WATCH_TASK,
    REAPER_TASK,
    RECONCILE_TASK,
)
from harness.env import base_env, free_port
from harness.processes import Worker
from harness.waits import wait_for

pytestmark = [pytest.mark.integration, pytest.mark.slow]

BEATS = {POWER_WATCH_TASK, REAPER_TASK, RECONCILE_TASK}


def beat_results(client: redis.Redis) -> dict[str, list[int]]:
    """The TTL of each stored result of the beat tasks, by task name."""
    found: dict[str, list[int]] = {}
    for key in client.scan_iter(match="celery-task-meta-*", count=500):
        meta = orjson.loads(client.get(key) or b"{}")
        if meta.get("name") in BEATS and meta.get("status") == "SUCCESS":
            found.setdefault(meta["name"], []).append(int(client.ttl(key)))
    return found


def test_beat_task_results_expire_within_the_hour(
    tmp_path: Path,
    redis_url: str,
    redis_client: redis.Redis,
    start_worker: Callable[..., Worker],
) -> None:
    env = base_env(
        redis_url,
        (tmp_path / "store").as_uri(),
        power_watch_interval_s=1,
        reaper_interval_s=1,
        reconcile_interval_s=1,
        port=free_port(),
    )
    start_worker(env, role="control").wait_ready()

    def each_beat() -> dict[str, list[int]] | None:
        found = beat_results(redis_client)
        return found if set(found) == BEATS else None

    found = wait_for(each_beat, 90, "a stored result of each beat task", 0.5)

    for name, ttls in found.items():
        assert all(0 < ttl <= BEAT_RESULT_EXPIRES_S for ttl in ttls), (name, ttls)
