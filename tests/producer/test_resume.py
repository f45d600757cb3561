"""`enqueue --resume` and `retry` trust the broker, not bookkeeping: an order lost from Redis
(a purged queue) is sent again; one waiting, unacknowledged or running is not doubled."""

from __future__ import annotations

from pathlib import Path

import orjson
import pytest
import redis

from genfleet.common import keys
from genfleet.common.settings import Settings
from genfleet.common.store import open_store
from genfleet.producer.broker import orders_in_broker
from genfleet.producer.enqueue import enqueue_run, reader_options

pytestmark = pytest.mark.integration

QUEUE = "gpu.emulator"  # the emulator's queue: these runs name no model


def stage_run(tmp_path: Path, redis_url: str) -> Settings:
    settings = Settings(redis_url=redis_url, store=(tmp_path / "store").as_uri(), batch_size=10)
    source = tmp_path / "p.jsonl"
    source.write_bytes(b"".join(orjson.dumps({"prompt": f"q{i}"}) + b"\n" for i in range(50)))
    result = enqueue_run(settings, "r", str(source), reader_options(settings))
    assert (result.batches_total, result.batches_enqueued) == (5, 5)
    return settings


def test_resume_sends_exactly_the_orders_the_broker_lost(
    tmp_path: Path, redis_url: str, redis_client: redis.Redis
) -> None:
    settings = stage_run(tmp_path, redis_url)
    options = reader_options(settings)
    assert orders_in_broker(redis_client, QUEUE, "r") == {keys.batch_id(i) for i in range(5)}
    assert enqueue_run(settings, "r", None, options, verify=True).batches_enqueued == 0

    # a worker took batch 0 (unacked), batch 1 is running elsewhere, batch 4 is done;
    # then the queue was purged: batches 2 and 3 have no order anywhere
    waiting = redis_client.lrange(QUEUE, 0, -1)
    redis_client.delete(QUEUE)
    redis_client.hset(keys.UNACKED, "tag-1", orjson.dumps([orjson.loads(waiting[-1]), "", QUEUE]))
    redis_client.hset(keys.running_key(), "r/batch-000001", b"{}")
    store = open_store(settings.store)
    store.put_if_absent(keys.output_key("r", "batch-000004"), b"done")

    # the bookkeeping alone still believes all five are outstanding
    assert enqueue_run(settings, "r", None, options).batches_enqueued == 0
    resumed = enqueue_run(settings, "r", None, options, verify=True)
    assert resumed.batches_enqueued == 2
    assert resumed.batches_done == 1
    assert redis_client.llen(QUEUE) == 2  # the two lost orders, and only those
    assert orders_in_broker(redis_client, QUEUE, "r") == {keys.batch_id(i) for i in range(4)}
    # and a second resume sends nothing more
    assert enqueue_run(settings, "r", None, options, verify=True).batches_enqueued == 0
