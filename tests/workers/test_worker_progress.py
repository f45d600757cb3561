"""A worker's live progress: one write an interval for all its running batches (and one when a
batch ends), not one per batch; nothing lost to a Redis blip, nothing counted twice."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator

import pytest

from genfleet.common import keys, throughput
from genfleet.common.records import PromptRecord, WorkOrder, encode_jsonl_gz
from genfleet.workers.batch import execute
from genfleet.workers.feeding.feeder import Feeder
from genfleet.workers.observe.live_progress import ProgressTally
from harness.services import RedisServer
from tests.fakes.engine import FakeChat, FakeEngine
from tests.fakes.memory_redis import MemoryRedis
from tests.fakes.memory_store import MemoryStore
from tests.support.command_log import CommandLog
from tests.support.core import PARAMS

WORKER = "w@test"


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_the_tally_is_written_once_an_interval_for_every_run_and_kept_across_a_blip() -> None:
    db, clock = MemoryRedis(), Clock()
    tally = ProgressTally(interval_s=2.0, clock=clock)
    tally.add("a", 3, 30)
    tally.add("b", 1, 5)
    tally.add("a", 1, 10)
    assert not tally.report(db, WORKER)  # not due: nothing written
    assert db.hgetall(keys.counters_key("a")) == {}
    clock.now = 2.0
    assert tally.report(db, WORKER)
    assert db.hgetall(keys.counters_key("a")) == {
        b"prompts_generated": b"4",
        b"tokens_generated": b"40",
    }
    assert db.hget(keys.counters_key("b"), "tokens_generated") == b"5"
    tally.add("a", 2, 20)
    assert not tally.report(db, WORKER)  # written just now
    db.down = True
    assert not tally.report(db, WORKER, now_due=True)  # a batch ended, Redis is away: kept
    db.down = False
    clock.now = 3.0
    assert not tally.report(db, WORKER)  # the failed write counts as the interval's
    clock.now = 4.0
    assert tally.report(db, WORKER)
    assert db.hget(keys.counters_key("a"), "prompts_generated") == b"6"
    assert not tally.report(db, WORKER, now_due=True)  # nothing left to write


def order_of(store: MemoryStore, run: str, batch: str, prompts: int) -> WorkOrder:
    records = [
        PromptRecord(id=f"{batch}-{i}", messages=[{"role": "user", "content": f"q{i}"}])
        for i in range(prompts)
    ]
    key = keys.input_key(run, batch)
    store.put(key, encode_jsonl_gz(r.to_json() for r in records))
    return WorkOrder(
        run=run, batch=batch, params=PARAMS, model="emulator", engine="emulator", prompts=prompts
    )


@pytest.fixture
def feeder() -> Iterator[Feeder]:
    # Four batches of eight side by side, the i-th prompt of each answered after (i + 1) / 4
    # s: each batch finishes a prompt every quarter second for two seconds.
    chat = FakeChat(tokens=5, delay_s=lambda r: (int(r.id.rsplit("-", 1)[1]) + 1) / 4)
    feeder = Feeder(lambda: chat, FakeEngine(), 32, retries=0, backoff_s=lambda _: 0.0)
    yield feeder
    feeder.close()


def test_several_running_batches_write_their_progress_once_an_interval(
    private_redis: RedisServer, feeder: Feeder
) -> None:
    client = private_redis.client()
    store = MemoryStore()
    orders = [order_of(store, "pa", keys.batch_id(i), 8) for i in range(3)]
    orders.append(order_of(store, "pb", keys.batch_id(0), 8))
    interval_s = 0.25
    tally = ProgressTally(interval_s=interval_s)
    errors: list[BaseException] = []

    def run(order: WorkOrder) -> None:
        try:
            execute(
                order,
                store=store,
                client=client,
                feeder=feeder,
                worker=WORKER,
                lease_ttl_s=30,
                checkpoint_interval_s=60,
                progress=tally,
            )
        except BaseException as exc:  # noqa: BLE001 - reported by the test
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(order,)) for order in orders]
    with CommandLog(client) as log:
        started = time.monotonic()
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(timeout=60)
        took_s = time.monotonic() - started
    assert not errors, errors
    assert took_s > 1.0, took_s  # the batches ran side by side for several intervals

    writes = log.count(f"HINCRBY {keys.counters_key('pa')} prompts_generated")
    # One an interval for all of the worker's batches, and one as each of the four ends;
    # one a batch an interval (the three of run pa each writing) would be three times more.
    assert 2 <= writes <= took_s / interval_s + 1 + len(orders), (writes, took_s)
    for run, batches in (("pa", 3), ("pb", 1)):
        counters = client.hgetall(keys.counters_key(run))
        assert counters[b"prompts_generated"] == str(8 * batches).encode()
        assert counters[b"tokens_generated"] == str(40 * batches).encode()
        assert counters[b"prompts_done"] == str(8 * batches).encode()
        buckets = client.keys(keys.throughput_bucket_key(run, 0).removesuffix("0") + "*")
        tokens = sum(int(client.hget(bucket, "") or 0) for bucket in buckets)
        assert tokens == 40 * batches
        assert all(0 < client.pttl(b) <= (throughput.KEEP_S + 10) * 1000 for b in buckets)
    client.close()
