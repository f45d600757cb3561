"""One point of a sweep: keep C requests in flight on an engine for a while and measure it.

`measure` drives a `Load` (exactly C requests in flight, after a ramp, for a fixed window)
while a thread samples the GPU (energy counter) and the engine (/server_info, /metrics);
`judge` turns the readings into a `Point` with tok/s, mean power, J/token and the power-watch
verdict for "work waits". `genfleet tune` runs one per configuration and concurrency.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import httpx

from genfleet.common.errors import (
    EngineConfigError,
    EngineError,
    RequestFailed,
    RequestRejected,
)
from genfleet.common.records import GenerationParams, PromptRecord
from genfleet.common.settings import Settings
from genfleet.workers.engine.supervisor import EngineSupervisor
from genfleet.workers.feeding import ChatResult, EngineClient
from genfleet.workers.observe.diagnosis import FleetState, diagnose, verdicts
from genfleet.workers.observe.engine_state import (
    EngineState,
    engine_state_from_metrics,
    engine_state_from_server_info,
)
from genfleet.workers.observe.telemetry import GpuSample, Sampler, TelemetryWindow
from genfleet.workers.tune.sweep import (
    Point,
    TuneConfig,
    answer_tokens_in_window,
    tokens_in_window,
)

log = logging.getLogger("genfleet.tune")


@dataclass
class Live:
    """What the sampling thread and the drive share while one point runs."""

    samples: list[GpuSample] = field(default_factory=list)
    engine: dict[str, Any] = field(default_factory=dict)
    finished: list[tuple[float, float, int]] = field(default_factory=list)
    streamed: list[tuple[float, int]] = field(default_factory=list)  # (time, tokens) by chunk
    usage_streamed: bool = False  # an answer carried the engine's token count
    errors: int = 0
    start_ts: float | None = None  # when the window's opening GPU reading was taken
    end_ts: float | None = None  # when the window's closing GPU reading was taken
    stop: threading.Event = field(default_factory=threading.Event)


def completion_tokens(result: ChatResult, max_tokens: int) -> int:
    """Output tokens of one answer: the engine's usage, else max_tokens for a `length` stop
    (`transformers serve` sends no usage; a random model always runs to max_tokens)."""
    if result.usage.completion_tokens:
        return result.usage.completion_tokens
    return max_tokens if result.finish_reason == "length" else 0


async def drive(
    client: EngineClient,
    prompts: Iterator[PromptRecord],
    params: GenerationParams,
    concurrency: int,
    until: float,
    drain_s: float,
    live: Live,
) -> None:
    """Keep `concurrency` requests in flight until `until` (time.time()), then let the ones
    running finish for at most `drain_s`; finished requests land in `live.finished`, and
    every streamed chunk's tokens in `live.streamed` as it arrives."""

    def on_tokens(tokens: int) -> None:
        live.streamed.append((time.time(), tokens))

    async def lane() -> None:
        while time.time() < until and not live.stop.is_set():
            record = next(prompts)
            start = time.time()
            try:
                result = await client.chat(record, params, on_tokens=on_tokens)
            except (EngineError, RequestRejected, RequestFailed, EngineConfigError) as exc:
                live.errors += 1
                log.warning("request failed: %s", exc)
                await asyncio.sleep(0.2)
                continue
            tokens = completion_tokens(result, params.max_tokens)
            live.finished.append((start, time.time(), tokens))
            live.usage_streamed = live.usage_streamed or result.usage.completion_tokens > 0

    lanes = [asyncio.create_task(lane()) for _ in range(concurrency)]
    pending = set(lanes)
    try:
        _, pending = await asyncio.wait(lanes, timeout=max(0.0, until - time.time()) + drain_s)
    finally:  # past the drain, or the drive itself cancelled (an interrupt): no lane outlives it
        for task in pending:
            task.cancel()
        await asyncio.gather(*pending, return_exceptions=True)


class EngineReader:
    """Engine figures for the verdict: /server_info and /metrics where the engine has them."""

    def __init__(self, supervisor: EngineSupervisor, settings: Settings) -> None:
        self.supervisor = supervisor
        self.sglang_like = settings.engine_kind in {"sglang", "emulator"}
        self.metrics = self.sglang_like and settings.enable_metrics
        self._http = httpx.Client(timeout=2.0)

    def read(self) -> dict[str, Any]:
        if not self.sglang_like:
            return {}
        state = engine_state_from_server_info(self.supervisor.refresh_info())
        if self.metrics:
            with contextlib.suppress(httpx.HTTPError):
                response = self._http.get(self.supervisor.base_url + "/metrics")
                if response.status_code == 200:
                    state.update(engine_state_from_metrics(response.text))
        return state

    def close(self) -> None:
        self._http.close()


def sample_loop(
    sampler: Sampler,
    reader: EngineReader,
    live: Live,
    interval_s: float,
    tick: Callable[[], None],
    until: float = float("inf"),
) -> None:
    """The point's sampling thread: GPU readings and engine state about every interval.

    The engine state stops at the window's end (`until`): while the load drains the running
    batch shrinks, and an adaptive engine's accept length with it.
    """
    while not live.stop.wait(interval_s):
        live.samples.extend(sampler.sample())
        if time.time() <= until:
            with contextlib.suppress(httpx.HTTPError, ValueError):
                live.engine = reader.read() or live.engine
        tick()


def window_tokens(live: Live, t0: float, t1: float) -> float:
    """The point's output tokens in [t0, t1]: those streamed, where the engine counts them
    (SGLang's usage on every chunk); else, where answers ended without a count (`transformers
    serve`), their lengths spread over their lives, since a chunk's size is a guess there."""
    if live.usage_streamed or not live.finished:
        return tokens_in_window(live.streamed, t0, t1)
    return answer_tokens_in_window(live.finished, t0, t1)


def judge(
    config: TuneConfig,
    concurrency: int,
    cap: int | None,
    live: Live,
    window: tuple[float, float],
    settings: Settings,
) -> Point:
    """Turn one point's readings into a Point: energy-counter power, tokens, verdict."""
    t0, t1 = window
    duration = t1 - t0
    tokens = window_tokens(live, t0, t1)
    telemetry = TelemetryWindow(duration)
    telemetry.add(s for s in live.samples if t0 <= s.ts <= t1)
    engine = {"max_running_requests": cap, **live.engine}
    # only SGLang (and its emulator) report whether MTP runs; don't blame it elsewhere
    engine.setdefault("spec_reported", settings.engine_kind in {"sglang", "emulator"})
    state = EngineState(up=True, inflight=concurrency, inflight_cap=concurrency, **engine)
    telemetry.add_engine(state, t1)
    telemetry.add_tokens(round(tokens), t1)
    summary = telemetry.summary(t1)
    gpus = summary["gpus"]
    power = summary["power_w"]
    limit = sum(g["power_limit_w"] for g in gpus) if gpus else None
    tokens_per_s = tokens / duration if duration > 0 else 0.0
    fleet = FleetState(queue_depth=1)  # tune keeps work waiting by construction
    args = ({"tune": summary}, fleet, t1, settings.underuse_threshold, settings.min_accept_length)
    rows = verdicts(*args)
    findings = diagnose(*args)
    other = tuple(findings[0].numbers.get("other_causes", ())) if findings else ()
    return Point(
        config=config.label,
        concurrency=concurrency,
        duration_s=round(duration, 3),
        requests=sum(1 for _, end, _ in live.finished if t0 < end <= t1),
        errors=live.errors,
        tokens=round(tokens, 1),
        tokens_per_s=tokens_per_s,
        power_w=power,
        power_limit_w=limit,
        j_per_token=power / tokens_per_s if power and tokens_per_s > 0 else None,
        accept_length=state.accept_length,
        verdict=rows[0]["verdict"] if rows else "unknown",
        cause=rows[0]["cause"] if rows else None,
        other_causes=other,
        max_running_requests=cap,
    )


@dataclass
class Load:
    """One point's load: who to ask, what, how many at once, for how long."""

    client: EngineClient
    prompts: Iterator[PromptRecord]
    params: GenerationParams
    concurrency: int
    seconds: float
    ramp_s: float
    drain_s: float


def measure(
    load: Load,
    sampler: Sampler,
    reader: EngineReader,
    show: Callable[[str, float], None],
    what: str,
) -> tuple[Live, tuple[float, float]]:
    """Run one load with GPU and engine sampling around it; returns readings and window."""
    live = Live()
    ramp_s = load.ramp_s
    t0 = time.time() + ramp_s
    until = t0 + load.seconds

    def tick() -> None:
        rate = window_tokens(live, t0, time.time()) / max(time.time() - t0, 1e-9)
        show(f"{what}: {rate:,.0f} tok/s", min(time.time(), until) - t0 + ramp_s)

    interval_s = min(1.0, load.seconds / 10)
    sampling = threading.Thread(
        target=sample_loop, args=(sampler, reader, live, interval_s, tick, until), daemon=True
    )
    opening = threading.Thread(target=_sample_at, args=(sampler, live, t0, "start_ts"))
    closing = threading.Thread(target=_sample_at, args=(sampler, live, until, "end_ts"))

    interrupted: list[int] = []

    async def go() -> None:
        with _signal_cancels(asyncio.get_running_loop(), interrupted):
            try:
                await drive(
                    load.client,
                    load.prompts,
                    load.params,
                    load.concurrency,
                    until,
                    load.drain_s,
                    live,
                )
            finally:
                await load.client.aclose()

    sampling.start()
    opening.start()
    closing.start()
    try:
        try:
            asyncio.run(go())
        except asyncio.CancelledError:
            if not interrupted:
                raise
        if interrupted:  # here, between two statements of this function: a safe place
            raise KeyboardInterrupt
        opening.join()
        closing.join()
    finally:
        live.stop.set()
        sampling.join(timeout=5)
    return live, (live.start_ts or t0, live.end_ts or until)


@contextlib.contextmanager
def _signal_cancels(loop: asyncio.AbstractEventLoop, interrupted: list[int]) -> Iterator[None]:
    """While a point's requests run, SIGTERM cancels them at their next `await` (the way
    `asyncio.run` treats Ctrl-C), where the sweep's own handler would raise
    KeyboardInterrupt at whatever bytecode runs: inside an HTTP library holding a lock or
    half-way through a connection's state, its cleanup could then wait forever, the engine
    never stopped and the points never written. The signal's number lands in `interrupted`;
    `measure` raises KeyboardInterrupt once the loop is done. Off the main thread (no
    signals there) it does nothing."""
    task = asyncio.current_task()
    if task is None or threading.current_thread() is not threading.main_thread():
        yield
        return

    def cancel(signum: int, frame: object) -> None:
        interrupted.append(signum)
        loop.call_soon_threadsafe(task.cancel)  # safe from a handler: no lock, a self-pipe

    previous = signal.signal(signal.SIGTERM, cancel)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def _sample_at(sampler: Sampler, live: Live, when: float, edge: str) -> None:
    """One GPU reading right at an edge of the window, so the energy delta spans all of it;
    its timestamp is that edge (`edge` is "start_ts" or "end_ts")."""
    delay = when - time.time()
    if delay > 0:
        time.sleep(delay)
    reading = sampler.sample()
    live.samples.extend(reading)
    setattr(live, edge, reading[0].ts if reading else None)
