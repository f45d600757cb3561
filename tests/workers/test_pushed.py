"""Pushed GPU summaries (workers/observe/pushed.py) read by the power-watch, on real Redis.

Silence is measured by Redis's own clock: a summary pushed longer ago than its TTL makes its
worker a `worker_unresponsive` finding with how long it has been silent; past FORGET_S it is
pruned from every registry; a worker that stops cleanly is gone, not silent. The pushes'
times are moved back in the sorted set directly (no waiting).
"""

from __future__ import annotations

import time

import orjson
import pytest
import redis
from pydantic import SecretStr

from genfleet.common import engine_alarms, keys, summaries
from genfleet.common.settings import Settings
from genfleet.workers.observe import pushed
from genfleet.workers.observe.power_watch import watch_pass

pytestmark = pytest.mark.integration


def summary(worker: str) -> dict[str, object]:
    return {"worker": worker, "ts": time.time(), "gpus": [], "engine": {}, "node": "n1"}


def age(client: redis.Redis, worker: str, seconds: float) -> None:
    """As if `worker` last pushed `seconds` ago, by Redis's clock."""
    now_s, micros = client.time()
    client.zadd(keys.pushed_key(), {worker: now_s + micros / 1e6 - seconds})


def test_a_silent_worker_becomes_a_finding(redis_url: str, redis_client: redis.Redis) -> None:
    settings = Settings(redis_url=SecretStr(redis_url))
    for worker in ("w1@n1", "w2@n1"):
        pushed.push(redis_client, worker, summary(worker))
    age(redis_client, "w2@n1", settings.summary_ttl_s + 30)

    report = watch_pass(redis_client, settings, time.time())

    assert report["workers"] == ["w1@n1"]
    silent = [f for f in report["findings"] if f["cause"] == "worker_unresponsive"]
    assert [f["worker"] for f in silent] == ["w2@n1"]
    assert silent[0]["numbers"]["summary_age_s"] >= settings.summary_ttl_s + 30
    assert report["new_findings"] >= 1
    stream = [orjson.loads(f[b"finding"]) for _, f in redis_client.xrange(keys.findings_key())]
    assert "w2@n1" in {f["worker"] for f in stream}


def test_a_worker_silent_for_long_is_pruned_and_one_that_stopped_is_gone(
    redis_url: str, redis_client: redis.Redis
) -> None:
    settings = Settings(redis_url=SecretStr(redis_url))
    for worker in ("w1@n1", "w2@n1", "w3@n1"):
        pushed.push(redis_client, worker, summary(worker))
        # each with its engine's alarm (restart budget spent): w2 is then killed outright
        engine_alarms.publish(redis_client, worker, {"queue": "gpu.m", "ts": time.time()})
    watch_pass(redis_client, settings, time.time())  # all three seen
    age(redis_client, "w2@n1", pushed.FORGET_S + 1)
    pushed.withdraw(redis_client, "w3@n1")  # stopped cleanly

    report = watch_pass(redis_client, settings, time.time())

    assert not [f for f in report["findings"] if f["cause"] == "worker_unresponsive"]
    assert redis_client.zrange(keys.pushed_key(), 0, -1) == [b"w1@n1"]
    assert set(redis_client.hkeys(keys.summaries_key())) == {b"w1@n1"}
    assert b"w2@n1" not in redis_client.hkeys(keys.workers_key())
    # the dead worker's alarm is forgotten with it, not shown by status forever
    assert [a["worker"] for a in engine_alarms.of_queue(redis_client, "gpu.m")] == [
        "w1@n1",
        "w3@n1",
    ]
    assert redis_client.ttl(keys.summaries_key()) > 0  # the keys go if the fleet does


def test_a_worker_whose_engine_is_starting_is_a_starting_node_not_a_sample(
    redis_url: str, redis_client: redis.Redis
) -> None:
    settings = Settings(redis_url=SecretStr(redis_url))
    pushed.push(redis_client, "w1@n2", {"worker": "w1@n2", "ok": False, "node": "n2"})

    found = summaries.read(redis_client, settings.summary_ttl_s)

    assert found.samples == {} and found.starting_nodes == {"n2"} and found.silent_s == {}
