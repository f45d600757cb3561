"""A dead worker's batch goes back to the front of its queue, not behind every order queued:
the reaper moves the dead delivery's own message to the list's consuming end (kombu's restore,
done at once), so the next worker with room takes it. Real Redis, real kombu messages (sent by
the producer's Celery app, taken off the queue as a worker's BRPOP does, and read back by a
kombu consumer)."""

from __future__ import annotations

from typing import Any

import orjson
import pytest
import redis
from kombu import Connection

from genfleet.common import keys
from genfleet.common.ledger import Ledger, running_field, work_order_of
from genfleet.common.records import WorkOrder
from genfleet.common.settings import Settings
from genfleet.producer.broker import make_client_app, send_orders
from genfleet.workers.control.reaper import reap
from tests.fakes.memory_store import MemoryStore
from tests.support.core import PARAMS

pytestmark = pytest.mark.integration

NOW, TTL_S = 1_000_000.0, 60.0
QUEUE = "gpu.emulator"
LOST, FRESH = keys.batch_id(9), [keys.batch_id(i) for i in range(3)]


def order(batch: str, staging: str = "s1") -> WorkOrder:
    return WorkOrder(
        run="r",
        batch=batch,
        params=PARAMS,
        model="emulator",
        engine="emulator",
        prompts=5,
        staging=staging,
    )


def consumed(redis_url: str, count: int) -> list[str]:
    """The batches of the next `count` messages a kombu consumer of the queue takes."""
    taken: list[str] = []
    with Connection(redis_url) as connection:
        queue = connection.SimpleQueue(QUEUE, no_ack=True)
        for _ in range(count):
            message = queue.get(timeout=5)
            taken.append(str(message.payload[1]["order"]["batch"]))
        queue.close()
    return taken


@pytest.mark.parametrize(
    ("dead_copy_staging", "front"),
    [
        ("s1", True),  # the dead worker's copy is of this very order: moved to the front
        ("s0", False),  # an earlier staging's copy would be dropped as superseded: sent anew
        (None, False),  # no copy left: sent anew, to the back
    ],
)
def test_a_dead_workers_batch_is_taken_before_the_orders_queued(
    redis_url: str, redis_client: redis.Redis, dead_copy_staging: str | None, front: bool
) -> None:
    settings = Settings(redis_url=redis_url, store="file:///tmp/unused")
    lost = order(LOST)
    send_orders(
        make_client_app(settings),
        settings,
        [order(LOST, dead_copy_staging or "s1"), *(order(b) for b in FRESH)],
    )
    raw = redis_client.rpop(QUEUE)  # the first order queued, delivered to a worker that dies
    assert raw is not None and work_order_of(raw) == ("r", LOST)
    if dead_copy_staging is not None:
        message = orjson.loads(raw)
        redis_client.hset(keys.UNACKED, "dead-tag", orjson.dumps([message, QUEUE, QUEUE]))
        redis_client.zadd(keys.UNACKED_INDEX, {"dead-tag": NOW - 1000})
    claimed = lost.model_dump(mode="json")
    Ledger(redis_client).claim(claimed, "w@gone", NOW - 1000, presence="gone")
    requeued: list[dict[str, Any]] = []

    def reap_at(now: float) -> dict[str, Any]:
        return reap(
            redis_client, MemoryStore(), TTL_S, now, requeued.append, 10, set(), lambda o: QUEUE
        )

    reap_at(NOW - TTL_S)  # the first look at the gone worker
    report = reap_at(NOW)

    assert report["requeued"] == [running_field("r", LOST)]
    assert redis_client.hlen(keys.UNACKED) == 0 and redis_client.zcard(keys.UNACKED_INDEX) == 0
    if front:
        assert requeued == []  # no second copy: the dead one moved
        assert consumed(redis_url, 4) == [LOST, *FRESH]
        assert redis_client.llen(QUEUE) == 0
    else:
        assert requeued == [claimed]  # the beat sends this one to the back
        assert consumed(redis_url, 3) == FRESH


def test_the_moved_message_is_marked_redelivered_under_a_new_tag(
    redis_url: str, redis_client: redis.Redis
) -> None:
    settings = Settings(redis_url=redis_url, store="file:///tmp/unused")
    send_orders(make_client_app(settings), settings, [order(LOST)])
    message = orjson.loads(redis_client.rpop(QUEUE) or b"")
    redis_client.hset(keys.UNACKED, "dead-tag", orjson.dumps([message, QUEUE, QUEUE]))

    assert Ledger(redis_client).redeliver("dead-tag", QUEUE)
    assert not Ledger(redis_client).redeliver("dead-tag", QUEUE)  # moved once, not twice

    (moved,) = [orjson.loads(m) for m in redis_client.lrange(QUEUE, 0, -1)]
    assert moved["body"] == message["body"] and moved["headers"]["redelivered"] is True
    assert moved["properties"]["delivery_tag"] != message["properties"]["delivery_tag"]
