"""Fail fast, never loop, never lose an order: the task and reaper paths of it, on the fakes
(see test_core_tasks.py for how `generate_batch` is called without a broker)."""

from __future__ import annotations

import threading
from typing import Any

import orjson
import pytest
from celery.exceptions import Reject

from genfleet.common import keys
from genfleet.common.backoff import Backoff
from genfleet.common.celery_config import GENERATE_TASK
from genfleet.common.errors import EngineDown
from genfleet.common.ledger import Ledger, running_field
from genfleet.workers import tasks as tasks_module
from genfleet.workers.control.reaper import reap
from genfleet.workers.tasks import BatchFailed, generate_batch
from harness.waits import meanwhile, wait_for
from tests.fakes.engine import FakeChat
from tests.fakes.memory_redis import MemoryRedis
from tests.fakes.memory_store import MemoryStore
from tests.support.core import (
    BATCH,
    NOW,
    RUN,
    TTL_S,
    MakeRuntime,
    batch_state,
    running_order,
    stage_task,
)


def unacked(db: MemoryRedis, tag: str, order: dict[str, Any]) -> None:
    """A delivered, unacknowledged copy of `order` as kombu keeps it on Redis."""
    body = orjson.dumps([[], {"order": order}, {}]).decode()
    message = {"body": body, "headers": {"task": GENERATE_TASK}, "properties": {}}
    db.hset(keys.UNACKED, tag, orjson.dumps([message, "", "gpu"]))
    db.zadd(keys.UNACKED_INDEX, {tag: NOW})


def test_a_batch_whose_worker_dies_every_time_is_parked_at_max_deliveries() -> None:
    db, store = MemoryRedis(), MemoryStore()
    requeued: list[dict[str, Any]] = []
    for delivery in (1, 2, 3):
        order = running_order(db, BATCH, NOW - 100)  # claimed, then its worker died: no lease
        unacked(db, f"tag{delivery}", order)
        reap(db, store, TTL_S, NOW - TTL_S, requeued.append, max_deliveries=3)  # first look
        report = reap(db, store, TTL_S, NOW, requeued.append, max_deliveries=3)
        assert not db.hgetall(keys.UNACKED), "the dead delivery stays in the broker"
        outcome = "parked" if delivery == 3 else "requeued"
        assert report[outcome] == [running_field(RUN, BATCH)]
    assert len(requeued) == 2
    reason = db.hget(keys.failed_key(RUN), BATCH).decode()
    assert reason.startswith("poison batch") and "3 deliveries" in reason
    assert int(db.hget(keys.lost_key(RUN), BATCH)) == 3


def test_a_requeue_that_cannot_be_sent_keeps_the_running_entry() -> None:
    db, store = MemoryRedis(), MemoryStore()
    order = running_order(db, BATCH, NOW - 100)
    unacked(db, "tag1", order)

    def broker_down(_order: dict[str, Any]) -> None:
        raise ConnectionError("broker down")

    reap(db, store, TTL_S, NOW - TTL_S, broker_down, max_deliveries=3)  # a first look
    with pytest.raises(ConnectionError):
        reap(db, store, TTL_S, NOW, broker_down, max_deliveries=3)
    assert db.hget(keys.running_key(), running_field(RUN, BATCH)) is not None
    assert int(db.hget(keys.lost_key(RUN), BATCH) or 0) == 0
    assert db.hgetall(keys.UNACKED), "the only other copy of the order was dropped"
    requeued: list[dict[str, Any]] = []
    reap(db, store, TTL_S, NOW, requeued.append, max_deliveries=3)
    assert len(requeued) == 1  # the next pass sends it


def test_redis_failing_before_the_batch_starts_requeues_the_message(
    make_runtime: MakeRuntime,
) -> None:
    runtime = make_runtime(FakeChat())
    order = stage_task(runtime, 2)
    runtime.redis.down = True

    with pytest.raises(Reject) as caught:
        generate_batch(order)
    assert caught.value.requeue


def test_a_failed_set_that_cannot_be_written_requeues_instead_of_acking(
    make_runtime: MakeRuntime, monkeypatch: pytest.MonkeyPatch
) -> None:
    runtime = make_runtime(FakeChat())
    order = stage_task(runtime, 2)

    def input_gone_and_redis_too(key: str) -> bytes | None:
        runtime.redis.down = True
        return None

    monkeypatch.setattr(runtime.store, "get", input_gone_and_redis_too)
    with pytest.raises(Reject) as caught:  # not BatchFailed: that would ack the only copy
        generate_batch(order)
    assert caught.value.requeue


def test_a_parked_batch_redelivered_by_the_broker_is_not_run(
    make_runtime: MakeRuntime,
) -> None:
    runtime = make_runtime(FakeChat())
    order = stage_task(runtime, 2)
    runtime.redis.hset(keys.lost_key(RUN), BATCH, 3)

    result = generate_batch(order)

    assert result["parked"] and not runtime.finished
    assert not runtime.store.exists(keys.output_key(RUN, BATCH))


def test_terminate_of_one_batch_parks_it_and_leaves_the_others(
    make_runtime: MakeRuntime,
) -> None:
    gate = threading.Event()
    chat = FakeChat(gate=gate, ungated={"p0"})
    runtime = make_runtime(chat)
    order = stage_task(runtime, 4)

    def terminate() -> None:
        assert runtime.feeder.cancel_batch(RUN, BATCH)
        assert not runtime.feeder.cancel_batch(RUN, "batch-000009")  # not running here

    terminated = meanwhile(lambda: chat.inflight == 3, terminate, "three requests in flight")
    with pytest.raises(BatchFailed, match="terminated by an operator"):
        generate_batch(order)
    terminated()
    gate.set()
    assert batch_state(runtime.redis)["failed"] == "BatchInterrupted"
    assert list(runtime.store.list(keys.parts_prefix(RUN, BATCH)))  # p0 is checkpointed


def test_a_retry_waits_out_its_backoff_under_a_lease_then_goes_straight_to_the_queue(
    make_runtime: MakeRuntime, monkeypatch: pytest.MonkeyPatch
) -> None:
    """No worker ever holds a delayed copy (one that dies with it would be invisible to the
    reaper): the backoff is spent here, with the batch running and leased."""
    runtime = make_runtime(FakeChat(failures={"p0": [EngineDown("engine gone")]}))
    order = stage_task(runtime, 2)
    monkeypatch.setattr(tasks_module, "BATCH_RETRY", Backoff(base_s=2.0, cap_s=2.0))
    seen: dict[str, Any] = {}

    def look() -> None:
        lease = keys.lease_key(RUN, BATCH)
        # In the backoff: the first try counted (the lease is held from the try's start on).
        wait_for(
            lambda: runtime.redis.get(lease) and batch_state(runtime.redis)["attempts"] == 1,
            10,
            "the lease held in the backoff",
            0.01,
        )
        seen.update(batch_state(runtime.redis), holder=runtime.redis.get(lease))

    looker = threading.Thread(target=look)
    looker.start()
    with pytest.raises(EngineDown):  # `retry` called directly re-raises the error
        generate_batch(order)
    looker.join(timeout=10)
    assert seen["running"] and seen["holder"] == b"w@test" and seen["attempts"] == 1
    assert not batch_state(runtime.redis)["running"]  # handed to the queue after the wait
    assert not runtime.redis.get(keys.lease_key(RUN, BATCH))


PRESENT, GONE = "genfleet-worker:w-live", "genfleet-worker:w-dead"


def claimed_by(db: MemoryRedis, batch: str, presence: str | None) -> dict[str, Any]:
    """A batch claimed a while ago by a worker with that connection name, its lease alive."""
    order = running_order(db, batch, NOW - 100)
    Ledger(db).claim(order, "w", NOW - 100, presence)
    db.set(keys.lease_key(RUN, batch), "w", px=int(TTL_S * 100 * 1000))
    return order


def test_a_batch_whose_worker_is_gone_is_reaped_before_its_lease_lapses() -> None:
    """Redis drops a dead process's connections at once: its batches go back on the second
    look half a lease later, while their leases still run. A batch whose worker's connection
    is there, or was never named, or when no one may list connections, waits for its lease."""
    db, store = MemoryRedis(), MemoryStore()
    dead = claimed_by(db, "batch-000001", GONE)
    claimed_by(db, "batch-000002", PRESENT)
    claimed_by(db, "batch-000003", None)
    requeued: list[dict[str, Any]] = []
    reap(db, store, TTL_S, NOW, requeued.append, present={PRESENT})  # a first look
    assert requeued == []
    reap(db, store, TTL_S, NOW + TTL_S / 4, requeued.append, present={PRESENT})
    assert requeued == [], "a connection back within a ping (after a Redis restart) is alive"
    report = reap(db, store, TTL_S, NOW + TTL_S / 2, requeued.append, present={PRESENT})
    assert requeued == [dead] and report["requeued"] == [running_field(RUN, "batch-000001")]
    reap(db, store, TTL_S, NOW + TTL_S, requeued.append, present=None)
    reap(db, store, TTL_S, NOW + 2 * TTL_S, requeued.append, present=None)
    assert requeued == [dead]


def test_an_order_a_dead_worker_never_claimed_goes_back_to_the_queue() -> None:
    """Delivered, not claimed (its admission still read the store) when the worker died: no
    lease says so, and the broker would deliver it again after hours. Its owner is on record
    from delivery; gone, the order goes back; a live owner's and an unnamed owner's stay, and
    an order nobody recorded goes back after half a lease (its worker died first)."""
    db, store = MemoryRedis(), MemoryStore()
    ledger = Ledger(db)
    orders = {}
    for n, owner in enumerate((GONE, PRESENT, None, "nobody"), start=1):
        batch = keys.batch_id(n)
        orders[batch] = running_order(db, batch, NOW)
        db.hdel(keys.running_key(), running_field(RUN, batch))  # delivered, never claimed
        unacked(db, f"tag{n}", orders[batch])
        if owner != "nobody":
            ledger.delivered(f"tag{n}", f"w{n}", owner)
    ledger.delivered("acked-long-ago", "w9", PRESENT)
    requeued: list[dict[str, Any]] = []
    reap(db, store, TTL_S, NOW, requeued.append, present={PRESENT})  # a first look
    assert requeued == []
    report = reap(db, store, TTL_S, NOW + TTL_S / 2, requeued.append, present={PRESENT})

    back = [keys.batch_id(1), keys.batch_id(4)]
    assert requeued == [orders[b] for b in back]
    assert report["given_back"] == [running_field(RUN, b) for b in back]
    assert sorted(db.hgetall(keys.UNACKED)) == [b"tag2", b"tag3"]
    assert set(ledger.deliveries()) == {"tag1", "tag2", "tag3"}  # the acked one forgotten
    assert int(db.hget(keys.lost_key(RUN), keys.batch_id(1)) or 0) == 1
    reap(db, store, TTL_S, NOW + TTL_S, requeued.append, present={PRESENT})
    assert len(requeued) == 2  # given back once
