"""A batch whose prompts are all in the engine hands its slot on: the worker takes the next
batch while the last one's stragglers run, so the engine does not drain waiting for them.

A real worker with `worker_concurrency` 1: before, it held one batch at a time (the next was
not even delivered until the first ended); now two batches run at once as soon as the first
has sent every prompt, and the run still ends with every output exactly once.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable
from pathlib import Path

import pytest
import redis

from genfleet.common import keys
from genfleet.common.records import CompletionRecord, GenerationParams, PromptRecord
from genfleet.common.settings import Settings
from genfleet.common.store import open_store
from genfleet.producer.status import run_status
from genfleet.workers.feeding.feeder import Feeder
from harness.env import base_env
from harness.processes import Worker
from harness.runs import stage_questions, wait_run_done
from harness.waits import wait_for
from tests.fakes.engine import FakeEngine


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
