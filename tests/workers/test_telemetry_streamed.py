"""A worker's tokens per second over a window shorter than its answers, on the emulator.

The power-watch, `genfleet top` and J/token read the tokens of the last `power_window_s`. Counted
when answers finish, a window inside long answers reads 0 (a real SGLang run read 0 / 128 / 0
tok/s in 20 s windows against 88 generated); counted as they stream, it reads what the engine
generates. Here a real `Feeder` and `EngineClient` drive the emulator process with answers
three windows long, and two `Monitor`s tick side by side: one fed the streamed count, one the
finished count.
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from genfleet.common.records import CompletionRecord, GenerationParams, PromptRecord
from genfleet.common.settings import Settings
from genfleet.workers.feeding import EngineClient, Feeder
from genfleet.workers.observe.engine_state import EngineState
from genfleet.workers.observe.sampler import Monitor
from genfleet.workers.observe.telemetry import GpuSample
from harness.env import ROOT, free_port
from tests.fakes.engine import FakeEngine
from tests.support.emulator import EMULATOR_FAST_ENV, Emulator

pytestmark = [pytest.mark.integration, pytest.mark.slow]

WINDOW_S = 2.0
TICK_S = 0.05
PROMPTS = 8
# At 10× real time an emulated step of 8 sequences takes (12 + 8 × 0.25) / 10 ms: about 700
# tokens a second each, so 3,600 tokens are about 5 s, the window two and a half times over.
ANSWER_TOKENS = 3600
STREAM_INTERVAL = 8


@pytest.fixture
def emulator(tmp_path: Path) -> Iterator[Emulator]:
    port = free_port()
    log_path = tmp_path / "engine.log"
    with log_path.open("wb") as log_file:
        proc = subprocess.Popen(
            [sys.executable, "-m", "genfleet.workers.engine.emulator", "--model-path",
             "test-model", "--port", str(port), "--stream-interval", str(STREAM_INTERVAL),
             "--max-running-requests", str(PROMPTS)],
            cwd=ROOT,
            env={**os.environ, **EMULATOR_FAST_ENV, "GENFLEET_EMULATOR_TIME_SCALE": "10"},
            stdout=log_file,
            stderr=subprocess.STDOUT,
        )  # fmt: skip
        engine = Emulator(proc, port, log_path)
        try:
            engine.wait_ready()
            yield engine
        finally:
            proc.terminate()
            try:
                proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


class NoGpu:
    """A sampler with no GPU to read: the test looks at tokens only."""

    available = True
    reason = None

    def sample(self) -> list[GpuSample]:
        return []


def test_a_window_inside_long_answers_reads_the_tokens_generated(emulator: Emulator) -> None:
    settings = Settings(power_window_s=WINDOW_S, enable_metrics=False)
    feeder = Feeder(
        lambda: EngineClient(
            emulator.base_url, model="test-model", stream_chunk_tokens=STREAM_INTERVAL
        ),
        FakeEngine(),
        PROMPTS,
        retries=0,
    )
    clock = [time.time()]

    def monitor(tokens: Any) -> Monitor:
        return Monitor(
            settings, "w@test", NoGpu(), lambda: EngineState(up=True), tokens, None,
            clock=lambda: clock[0],
        )  # fmt: skip

    streamed = monitor(lambda: feeder.streamed_tokens_total)
    finished = monitor(lambda: feeder.tokens_total)
    params = GenerationParams(max_tokens=ANSWER_TOKENS, temperature=0.0, top_p=1.0, thinking=False)
    records = [
        PromptRecord(f"p{i}", [{"role": "user", "content": f"count to {i}"}],
                     params={"ignore_eos": True})
        for i in range(PROMPTS)
    ]  # fmt: skip
    answers: list[CompletionRecord] = []
    lock = threading.Lock()

    def collect(index: int, record: CompletionRecord) -> None:
        with lock:
            answers.append(record)

    readings: list[tuple[float, float, float]] = []  # (now, streamed tok/s, finished tok/s)
    try:
        for m in (streamed, finished):
            m.tick()  # the windows begin before the answers: each spans a whole window
        started = time.time()
        future = feeder.run_batch("r", "batch-000000", records, params, collect)
        while not future.done():
            time.sleep(TICK_S)
            clock[0] = time.time()
            for m in (streamed, finished):
                m.tick()
            readings.append(
                (
                    clock[0],
                    streamed.report()["tokens_per_s"],
                    finished.report()["tokens_per_s"],
                )
            )
        future.result()
        ended = time.time()
    finally:
        for m in (streamed, finished):
            m.stop()
        feeder.close()

    assert [a.usage.completion_tokens for a in answers] == [ANSWER_TOKENS] * PROMPTS
    assert all(a.error is None for a in answers)
    generated_per_s = PROMPTS * ANSWER_TOKENS / (ended - started)
    assert ended - started > 2 * WINDOW_S  # the answers outlast the window
    # Windows wholly inside the answers: after the first full window, before the last answer.
    inside = [r for r in readings if started + WINDOW_S + 0.2 <= r[0] <= ended - 0.3]
    assert len(inside) >= 10, readings
    for now, tokens_per_s, old in inside:
        assert old == 0.0  # no answer finished yet: the finished count sees nothing
        assert tokens_per_s == pytest.approx(generated_per_s, rel=0.10), (now - started, inside)
    # Once every answer has ended, the streamed count is the exact one.
    assert feeder.streamed_tokens_total == feeder.tokens_total == PROMPTS * ANSWER_TOKENS
