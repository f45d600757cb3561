"""A batch whose prompts are all in the engine hands its slot on: the worker takes the next
batch while the last one's stragglers run, so the engine does not drain waiting for them.

A real worker with `worker_concurrency` 1: before, it held one batch at a time (the next was
not even delivered until the first ended); now two batches run at once as soon as the first
has sent every prompt, and the run still ends with every output exactly once.
"""

from __future__ import annotations

import asyncio
import itertools
import threading
from collections.abc import Callable
from pathlib import Path

import pytest
import redis
from kombu.asynchronous import Hub
from kombu.common import QoS

from genfleet.common import keys
from genfleet.common.records import CompletionRecord, GenerationParams, PromptRecord
from genfleet.common.settings import Settings
from genfleet.common.store import open_store
from genfleet.producer.status import run_status
from genfleet.workers.feeding.feeder import Feeder
from genfleet.workers.process.slots import TRANSIT_S, PrefetchSlots, room_left
from harness.env import base_env
from harness.processes import Worker
from harness.runs import stage_questions, wait_run_done
from harness.waits import wait_for
from tests.fakes.engine import FakeChat, FakeEngine


class SlowClient:
    """An engine client whose requests finish only when the test says so."""

    model = "m"

    def __init__(self) -> None:
        self.release = asyncio.Event()

    def drawing(self, record: object, params: object) -> str:
        return "a fake chat endpoint"

    def refusal(self, record: object, params: object) -> str:
        return "a fake chat endpoint"

    async def chat(
        self,
        record: PromptRecord,
        params: GenerationParams,
        timeout_s: float | None = None,
        on_begun: object = None,
        on_tokens: object = None,
        drawn: object = None,
    ) -> object:
        await self.release.wait()
        raise asyncio.CancelledError  # never reached in this test: the batch is cancelled

    async def aclose(self) -> None:
        return None


def test_on_sent_fires_when_the_last_prompt_enters_and_waiting_counts_down() -> None:
    client = SlowClient()
    feeder = Feeder(lambda: client, FakeEngine(), max_inflight=3)  # type: ignore[arg-type,return-value]
    sent = threading.Event()
    params = GenerationParams(max_tokens=8, temperature=0.0, top_p=1.0, thinking=False)
    records = [PromptRecord(f"p{i}", [{"role": "user", "content": "x"}]) for i in range(5)]
    done: list[CompletionRecord] = []
    try:
        first = feeder.run_batch("r", "b0", records[:2], params, lambda i, r: done.append(r))
        second = feeder.run_batch(
            "r", "b1", records[2:], params, lambda i, r: done.append(r), on_sent=sent.set
        )
        # 3 slots: b0's two prompts and one of b1's run, b1's other two wait for a slot
        wait_for(lambda: feeder.inflight == 3 and feeder.waiting == 2, 10, "a full limiter")
        assert not sent.is_set()
        first.cancel()  # frees two slots: b1's last prompts enter the engine
        wait_for(sent.is_set, 10, "on_sent once every prompt of b1 is sent")
        assert feeder.waiting == 0 and not second.done()
        second.cancel()
        wait_for(lambda: feeder.inflight == 0 and feeder.waiting == 0, 10, "an empty limiter")
    finally:
        feeder.close()


def test_the_hook_wired_at_start_names_each_batch_once_its_prompts_are_all_sent() -> None:
    """The worker wires its slot hand-over into the feeder once, at start: no batch passes a
    callback down, and the hook says which batch it is for."""
    client = SlowClient()
    seen: list[tuple[str, str]] = []
    feeder = Feeder(
        lambda: client, FakeEngine(), max_inflight=3, on_batch_sent=lambda r, b: seen.append((r, b))
    )  # type: ignore[arg-type,return-value]
    params = GenerationParams(max_tokens=8, temperature=0.0, top_p=1.0, thinking=False)
    records = [PromptRecord(f"p{i}", [{"role": "user", "content": "x"}]) for i in range(5)]
    try:
        first = feeder.run_batch("r", "b0", records[:2], params, lambda i, r: None)
        second = feeder.run_batch("r", "b1", records[2:], params, lambda i, r: None)
        wait_for(lambda: seen == [("r", "b0")] and feeder.waiting == 2, 10, "b0 sent, b1 waiting")
        first.cancel()
        wait_for(lambda: seen == [("r", "b0"), ("r", "b1")], 10, "b1 sent once b0 made room")
        second.cancel()
        wait_for(lambda: feeder.inflight == 0, 10, "an empty limiter")
    finally:
        feeder.close()


@pytest.mark.integration
@pytest.mark.slow
def test_the_next_batch_starts_while_stragglers_run(
    tmp_path: Path,
    redis_url: str,
    redis_client: redis.Redis,
    start_worker: Callable[..., Worker],
) -> None:
    store = (tmp_path / "store").as_uri()
    knobs = {"worker_concurrency": 1, "emulator_time_scale": 2, "batch_size": 4}
    worker = start_worker(base_env(redis_url, store, **knobs))
    settings = Settings(redis_url=redis_url, store=store, batch_size=4)
    stage_questions(settings, "slots", tmp_path, 24)
    worker.wait_ready()
    most = [0]

    def overlap() -> bool:
        running = redis_client.hlen(keys.running_key())
        most[0] = max(most[0], running)
        return most[0] >= 2

    wait_for(overlap, 60, "two batches running at once on a worker of concurrency 1", 0.02)
    wait_run_done(settings, redis_client, "slots", 120)
    status = run_status(open_store(store), redis_client, "slots")
    assert status["prompts_done"] == 24 and status["batches_failed"] == 0
    assert redis_client.hlen(keys.running_key()) == 0


class _Worker:
    """What `PrefetchSlots` reads of Celery's WorkController: the consumer's prefetch count
    (kombu's own `QoS`, replaced by a new one at each reconnect) and the pool's spare threads."""

    def __init__(self, spare_threads: int) -> None:
        self.pool = type("Pool", (), {"spare_threads": spare_threads})()
        self.consumer = type("Consumer", (), {})()
        self.hub = Hub()  # kombu's event loop, never started here: its ready callbacks count
        self.reconnect()

    def reconnect(self) -> None:
        self.consumer.qos = QoS(lambda prefetch_count: None, 3)  # the initial count, 3 slots


@pytest.mark.parametrize(
    ("steps", "prefetch"),
    [
        (["sent b0", "sent b1"], 5),
        (["sent b0", "sent b1", "ended b0"], 4),
        # the new consumer's count holds the slots still handed on, not its initial 3 alone
        (["sent b0", "sent b1", "reconnect"], 5),
        (["sent b0", "sent b1", "reconnect", "ended b1"], 4),
        (["sent b0", "reconnect", "sent b1", "reconnect", "ended b0"], 4),
        (["sent b0", "sent b1", "sent b2", "reconnect"], 5),  # two spare threads only
        (["sent b0", "ended b0", "reconnect"], 3),
        (["ended b0", "reconnect"], 3),  # a batch that never handed its slot on
    ],
)
def test_the_slots_handed_on_are_counted_on_the_consumer_after_a_reconnect(
    steps: list[str], prefetch: int
) -> None:
    worker = _Worker(spare_threads=2)
    slots = PrefetchSlots(lambda: worker, clock=itertools.count(0, 10).__next__)
    for step in steps:
        if step == "reconnect":
            worker.reconnect()
            slots.count_on(worker.consumer.qos)  # the consumer's event loop starts again
            continue
        what, batch = step.split()
        (slots.batch_sent if what == "sent" else slots.batch_ended)("r", batch)
    assert worker.consumer.qos.value == prefetch


def test_a_slot_handed_on_wakes_the_consumers_loop_at_once() -> None:
    """The raised count is applied by the consumer's event loop; woken, it fetches the next
    batch now, not at its next timer tick (a second later)."""
    worker = _Worker(spare_threads=1)
    slots = PrefetchSlots(lambda: worker, clock=itertools.count(0, 10).__next__)
    slots.batch_sent("r", "b0")
    assert len(worker.hub._ready) == 1  # one wake-up waiting for the loop
    slots.batch_sent("r", "b1")  # no spare thread left: the count stays, nothing to wake for
    assert worker.consumer.qos.value == 4 and len(worker.hub._ready) == 1


class _Engine:
    """The room `PrefetchSlots` reads: requests in the engine against its cap."""

    def __init__(self, cap: int) -> None:
        self.cap = cap
        self.inflight = 0

    def room(self) -> int:
        return room_left(self.inflight, self.cap)


@pytest.mark.parametrize(
    ("steps", "prefetch"),
    [
        # room: a sent batch hands its slot on; before any batch arrived, the next waits
        # until that one's batch does
        (["sent b0", "sent b1"], 4),
        (["sent b0", "sent b1", "arrived"], 5),
        (["sent b0", "arrived", "sent b1"], 5),
        # the queue gave nothing for TRANSIT_S: the next slot goes on all the same
        (["sent b0", "sent b1", "later", "left"], 5),
        # full: the sent batches hold their slots, the orders stay in the queue
        (["full", "sent b0", "sent b1"], 3),
        # an answer leaves room: one waiting slot goes on...
        (["full", "sent b0", "sent b1", "left"], 4),
        # ... and the next once its batch is in, if that batch left room
        (["full", "sent b0", "sent b1", "left", "arrived"], 5),
        (["full", "sent b0", "sent b1", "left", "full", "arrived"], 4),
        # a waiting batch that ends takes no slot with it, and hands none on later
        (["full", "sent b0", "ended b0", "left"], 3),
        # a batch handed on ends: its slot comes back; the waiting one's goes on with room
        (["sent b0", "arrived", "full", "sent b1", "ended b0"], 3),
        (["sent b0", "arrived", "full", "sent b1", "ended b0", "left"], 4),
        # no spare thread left (two): the third sent batch waits for one, not for room
        (["sent b0", "arrived", "sent b1", "arrived", "sent b2", "arrived"], 5),
        (["sent b0", "arrived", "sent b1", "arrived", "sent b2", "ended b0"], 5),
        (["sent b0", "arrived", "sent b1", "arrived", "sent b2", "ended b0", "ended b1"], 4),
    ],
)
def test_a_sent_batch_hands_its_slot_on_only_while_the_engine_has_room(
    steps: list[str], prefetch: int
) -> None:
    """A worker whose engine is full takes no more orders: they wait in the queue for a
    worker with room (the end of a run goes to both engines, not to the first that asked).
    Each answer that leaves the engine offers the waiting slots again: one at a time until a
    batch has arrived (here batches of one prompt, against a cap of 10)."""
    _play(steps, prefetch, spare_threads=2, cap=10)


@pytest.mark.parametrize(
    ("steps", "prefetch"),
    [
        # batches of 3 against a cap of 8: three slots go on at once (3 + 3 + 3 > 8 - 0)...
        (["sent b0", "arrived 3", "full", "sent b1", "sent b2", "sent b3", "sent b4"], 4),
        (["sent b0", "arrived 3", "full", "sent b1", "sent b2", "sent b3", "left"], 7),
        # ... the fourth once one of theirs arrived
        (["sent b0", "arrived 3", "full", "sent b1", "sent b2", "sent b3", "sent b4", "left"], 7),
        (
            ["sent b0", "arrived 3", "full", "sent b1", "sent b2", "sent b3", "sent b4", "left"]
            + ["arrived 3"],
            8,
        ),
        # handed-back batches of one unfinished prompt each: as many as the spare threads
        (["sent b0", "arrived 1", "full", "sent b1", "sent b2", "sent b3", "sent b4", "left"], 8),
        # a batch of 20 after one of 2: the mean (11) lets one go at a time against 8
        (["sent b0", "arrived 2", "sent b1", "arrived 20", "full", "sent b2", "sent b3"], 5),
        (
            ["sent b0", "arrived 2", "sent b1", "arrived 20", "full", "sent b2", "sent b3"]
            + ["left"],
            6,
        ),
        # the ones in transit past TRANSIT_S (the queue gave nothing) count no more
        (["sent b0", "arrived 4", "full", "sent b1", "sent b2", "sent b3", "left", "later"], 6),
        (
            ["sent b0", "arrived 4", "full", "sent b1", "sent b2", "sent b3", "left", "later"]
            + ["left"],
            7,
        ),
    ],
)
def test_as_many_slots_go_on_as_the_room_holds_batches_of_the_last_ones_size(
    steps: list[str], prefetch: int
) -> None:
    """A new worker fills its engine with a run's handed-back batches (a few unfinished
    prompts each) in a few fetches, not one fetch at a time; the batches fetched and not
    arrived count in the room at the size of the last ones."""
    _play(steps, prefetch, spare_threads=5, cap=8)


def _play(steps: list[str], prefetch: int, spare_threads: int, cap: int) -> None:
    worker, engine, now = _Worker(spare_threads=spare_threads), _Engine(cap=cap), [0.0]
    slots = PrefetchSlots(lambda: worker, room=engine.room, clock=lambda: now[0])
    for step in steps:
        if step == "full":
            engine.inflight = engine.cap
        elif step == "left":
            engine.inflight = 0
            slots.offer()  # the feeder's hook as a request leaves the engine
        elif step.startswith("arrived"):
            # the feeder's hook as a batch's prompts are counted (one, unless it says)
            slots.arrived(int(step.split()[1]) if " " in step else 1)
        elif step == "later":
            now[0] += TRANSIT_S
        else:
            what, batch = step.split()
            (slots.batch_sent if what == "sent" else slots.batch_ended)("r", batch)
    assert worker.consumer.qos.value == prefetch


def test_each_prompt_that_leaves_the_worker_offers_the_waiting_slots() -> None:
    """The feeder calls its hook as each prompt gets its record, and once for a batch
    cancelled with prompts unanswered, after they left its count of prompts held: a slot
    waiting for room goes on as soon as there is some."""
    params = GenerationParams(max_tokens=8, temperature=0.0, top_p=1.0, thinking=False)
    records = [PromptRecord(f"p{i}", [{"role": "user", "content": "x"}]) for i in range(3)]
    chat = FakeChat()
    held: list[int] = []
    feeder = Feeder(
        lambda: chat, FakeEngine(), max_inflight=3, on_answer_left=lambda: held.append(feeder.held)
    )  # type: ignore[arg-type,return-value]
    try:
        feeder.run_batch("r", "b0", records, params, lambda i, r: None).result(timeout=10)
        assert sorted(held) == [0, 1, 2]  # once each, after the prompt left the count
    finally:
        feeder.close()
    client, held = SlowClient(), []
    feeder = Feeder(
        lambda: client,
        FakeEngine(),
        max_inflight=3,
        on_answer_left=lambda: held.append(feeder.held),
    )  # type: ignore[arg-type,return-value]
    try:
        batch = feeder.run_batch("r", "b0", records, params, lambda i, r: None)
        wait_for(lambda: feeder.inflight == 3, 10, "three requests in the engine")
        assert held == [] and feeder.held == 3
        batch.cancel()
        wait_for(lambda: held == [0], 10, "the hook once, for the cancelled batch")
    finally:
        feeder.close()
