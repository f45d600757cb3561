"""The reaper finds dead workers' deliveries in kombu's unacked hash with one scan a pass, not
one read of the whole hash per lost batch: a fleet with 1,000 deliveries out and 40 dead
workers costs a few pages, not 40 times the hash."""

from __future__ import annotations

import math
from typing import Any

import orjson
import pytest

from genfleet.common import keys
from genfleet.common.celery_config import GENERATE_TASK
from genfleet.common.ledger import UNACKED_PAGE, running_field
from genfleet.common.records import WorkOrder
from genfleet.workers.control.reaper import reap
from harness.services import RedisServer
from tests.fakes.memory_store import MemoryStore
from tests.support.command_log import CommandLog
from tests.support.core import PARAMS

pytestmark = pytest.mark.integration

NOW, TTL_S = 1_000_000.0, 60.0
DELIVERED = 5000  # live workers' deliveries in the hash
LOST = 40  # batches whose worker died, each with its delivery still in the hash


def order(run: str, batch: str) -> dict[str, Any]:
    return WorkOrder(
        run=run, batch=batch, params=PARAMS, model="emulator", engine="emulator", prompts=5
    ).model_dump(mode="json")


def delivery(work: dict[str, Any]) -> bytes:
    """A delivered message as kombu keeps it in its unacked hash."""
    body = orjson.dumps([[], {"order": work}, {}]).decode()
    message = {"body": body, "headers": {"task": GENERATE_TASK}, "properties": {}}
    return orjson.dumps([message, "", "gpu.emulator"])


def test_a_reaper_pass_scans_the_unacked_hash_once(private_redis: RedisServer) -> None:
    client = private_redis.client()
    pipe = client.pipeline(transaction=False)
    for i in range(DELIVERED):
        pipe.hset(keys.UNACKED, f"live{i}", delivery(order("busy", keys.batch_id(i))))
        # each live worker recorded its delivery as it received it (BatchRequest)
        owner = {"worker": f"live{i % 50}@host", "presence": None}
        pipe.hset(keys.delivered_key(), f"live{i}", orjson.dumps(owner))
    for i in range(LOST):
        work = order("lost", keys.batch_id(i))
        pipe.hset(keys.UNACKED, f"dead{i}", delivery(work))
        pipe.zadd(keys.UNACKED_INDEX, {f"dead{i}": NOW - 1000})
        claimed = orjson.dumps({**work, "claimed_at": NOW - 1000, "worker": f"w{i}@gone"})
        pipe.hset(keys.running_key(), running_field("lost", keys.batch_id(i)), claimed)
    pipe.execute()
    store = MemoryStore()
    requeued: list[dict[str, Any]] = []
    reap(client, store, TTL_S, NOW - TTL_S, requeued.append)  # the first look at each lapse
    assert requeued == []

    with CommandLog(client) as log:
        report = reap(client, store, TTL_S, NOW, requeued.append)

    assert len(report["requeued"]) == LOST and len(requeued) == LOST
    reads = log.count(f"HGETALL {keys.UNACKED}") + log.count(f"HSCAN {keys.UNACKED} ")
    pages = math.ceil((DELIVERED + LOST) / UNACKED_PAGE)
    assert reads <= 2 * pages, (reads, pages)  # one scan (SCAN may split a page), not 40
    assert len(log.commands) <= 2 * pages + 12 * LOST, len(log.commands)
    assert client.hlen(keys.UNACKED) == DELIVERED  # the dead copies dropped, the live kept
    assert not client.hexists(keys.UNACKED, "dead0")
    assert client.zcard(keys.UNACKED_INDEX) == 0
    assert client.hlen(keys.delivered_key()) == DELIVERED  # the live owners kept
    client.close()
