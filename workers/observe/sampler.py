"""A worker's telemetry loop: GPU power, engine state and tokens, about once a second.

Samples go into a TelemetryWindow; its summary is what the `gpu_report` inspect command
returns to the power-watch and `genfleet top`, and what the worker's Prometheus exporter
shows. GPUs are read through NVML, or through the emulator's simulated draw when the engine
is the emulator; without either the report says "unavailable" and why.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import socket
import threading
import time
from collections.abc import Callable
from typing import Any

import httpx

from genfleet.common.settings import Settings
from genfleet.workers.observe.diagnosis import Finding, FleetState, diagnose
from genfleet.workers.observe.engine_state import EngineState, engine_state_from_metrics
from genfleet.workers.observe.telemetry import (
    EmulatorSampler,
    NvmlSampler,
    Sampler,
    TelemetryWindow,
)

log = logging.getLogger("genfleet.monitor")


def make_sampler(settings: Settings, base_url: str | None) -> Sampler:
    """NVML for real engines; the emulator's simulated GPU for the emulator."""
    if settings.engine_kind == "emulator" and base_url:
        return EmulatorSampler(base_url)
    gpus = [g.strip() for g in settings.gpus.split(",")] if settings.gpus else None
    return NvmlSampler(gpus)


class Monitor:
    """Runs on its own daemon thread; `report()` is safe from any thread.

    `tokens_total()` is the count of tokens the engine generated so far that the window's
    tokens/s and J/token are read from: the feeder's `streamed_tokens_total` (tokens as they
    stream), so that answers longer than the window still count while they run. That count
    may step back a little where an answer's exact usage corrects its estimate; the window
    only takes what rises above the highest count seen, so a correction is never counted twice.
    """

    def __init__(
        self,
        settings: Settings,
        worker: str,
        sampler: Sampler,
        engine_state: Callable[[], EngineState],
        tokens_total: Callable[[], int],
        base_url: str | None,
        clock: Callable[[], float] = time.time,
        fleet: Callable[[float], FleetState] | None = None,
        engine_pid: Callable[[], int | None] = lambda: None,
        waste: Callable[[], dict[str, int]] | None = None,
    ) -> None:
        self.settings = settings
        self._waste = waste  # the feeder's waste counters since the worker started
        self._engine_pid = engine_pid
        self.worker = worker
        self.sampler = sampler
        self.window = TelemetryWindow(settings.power_window_s)
        self._engine_state = engine_state
        self._tokens_total = tokens_total
        self._base_url = base_url
        self._clock = clock
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="monitor", daemon=True)
        self._tokens_seen = 0
        self._http = httpx.Client(timeout=2.0)
        self.exporter: Any = None
        self._fleet = fleet
        self._diagnosed_at = 0.0
        self._last_findings: list[Finding] = []
        self.active: dict[str, int] = {}  # run → batches running on this worker
        self._lock = threading.Lock()
        self._node_gpus: list[dict[str, Any]] = []
        self._gpu_uuids: list[str] = []
        self._energy: tuple[float | None, int] = (None, 0)

    def start(self) -> None:
        if self.settings.metrics_port is not None:
            from genfleet.workers.observe.prometheus import MetricsExporter

            self.exporter = MetricsExporter(self.worker)
            port = self.exporter.start(self.settings.metrics_port, self.settings.metrics_host)
            log.info("Prometheus metrics on %s:%d/metrics", self.settings.metrics_host, port)
        try:
            self.tick()  # the first report already has a sample
        except Exception:  # noqa: BLE001 - telemetry never takes the worker down
            log.exception("telemetry sample failed")
        self._thread.start()

    def batch_started(self, run: str) -> None:
        with self._lock:
            self.active[run] = self.active.get(run, 0) + 1

    def batch_finished(self, run: str) -> None:
        with self._lock:
            left = self.active.get(run, 0) - 1
            if left > 0:
                self.active[run] = left
            else:
                self.active.pop(run, None)

    def tick(self) -> None:
        """One sampling round (the loop calls it; tests may too)."""
        now = self._clock()
        samples = self.sampler.sample()
        self.window.add(samples)
        counters = [s.energy_j for s in samples]
        if samples:
            total = None if None in counters else sum(c for c in counters if c is not None)
            with self._lock:
                self._energy = (total, len(samples))
        self.window.set_sampler_status(self.sampler.available, self.sampler.reason)
        node = getattr(self.sampler, "node_gpus", None)
        if node is not None:
            owned = getattr(self.sampler, "gpu_uuids", None) or [s.gpu_uuid for s in samples]
            marked = mark_processes(node(), self._engine_pid())
            with self._lock:
                self._node_gpus, self._gpu_uuids = marked, list(owned)
        state = self._state()
        self.window.add_engine(state, now)
        tokens = self._tokens_total()
        if tokens > self._tokens_seen:
            self.window.add_tokens(tokens - self._tokens_seen, now)
            self._tokens_seen = tokens
        if self.exporter is not None:
            summary = self.window.summary(now)
            if self._waste is not None:
                summary["waste"] = self._waste()
            self.exporter.update(summary, state, self._findings(summary, now))

    def _findings(self, summary: dict[str, Any], now: float) -> list[Finding]:
        """This worker's own diagnosis for its Prometheus `genfleet_underused` gauge.

        The beat's power-watch judges the whole fleet every interval; the exporter needs the
        verdict between beats, and the rules are the same pure function, so the worker applies
        them to its own window (queue state from Redis, at most every few seconds).
        """
        if self._fleet is None:
            return []
        if now - self._diagnosed_at >= min(5.0, self.settings.power_watch_interval_s):
            self._diagnosed_at = now
            self._last_findings = diagnose(
                {self.worker: {"worker": self.worker, **summary}},
                self._fleet(now),
                now,
                self.settings.underuse_threshold,
                self.settings.min_accept_length,
            )
        return self._last_findings

    def _state(self) -> EngineState:
        """The runtime's view of the engine, with the engine's own `/metrics` on top (its
        per-interval accept length wins over /server_info's lifetime mean)."""
        state = self._engine_state()
        metrics: dict[str, Any] = {}
        if self._base_url and state.up and self.settings.enable_metrics:
            with contextlib.suppress(httpx.HTTPError):
                response = self._http.get(self._base_url + "/metrics")
                if response.status_code == 200:
                    metrics = engine_state_from_metrics(response.text)
        with self._lock:
            runs = sorted(self.active)
            active = sum(self.active.values())
        return dataclasses.replace(state, active_batches=active, runs=runs, **metrics)

    def _loop(self) -> None:
        while not self._stop.wait(self.settings.sample_interval_s):
            try:
                self.tick()
            except Exception:  # noqa: BLE001 - telemetry never takes the worker down
                log.exception("telemetry sample failed")

    def energy_reading(self) -> tuple[float | None, int]:
        """The worker's GPUs' energy counters summed (J; None when a GPU has none) and how
        many GPUs it read, as of the last sample (about once a second)."""
        with self._lock:
            return self._energy

    def report(self) -> dict[str, Any]:
        now = self._clock()
        with self._lock:
            node = {"node_gpus": self._node_gpus, "gpu_uuids": self._gpu_uuids}
        return {
            "worker": self.worker,
            **self.window.summary(now),
            "node": socket.gethostname(),
            **node,
            **({"waste": self._waste()} if self._waste is not None else {}),
        }

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=5)
        if self.exporter is not None:
            self.exporter.stop()
        self._http.close()
        close = getattr(self.sampler, "close", None)
        if close is not None:
            close()


def mark_processes(gpus: list[dict[str, Any]], engine_pid: int | None) -> list[dict[str, Any]]:
    """The node's GPUs with each process marked `engine`: True when it is in the engine's
    process group (the supervisor starts the engine as a group leader, its children stay in
    it), False when it is not, None when this worker cannot tell (no engine pid, or a pid
    from another pid namespace, as NVML reports inside a container)."""
    out = []
    for gpu in gpus:
        procs = []
        for proc in gpu.get("processes") or []:
            pid, engine, name = int(proc.get("pid") or 0), None, None
            if engine_pid is not None and pid > 0:
                try:
                    engine = os.getpgid(pid) == engine_pid
                    with open(f"/proc/{pid}/comm") as comm:
                        name = comm.read().strip()
                except OSError:  # gone, or not in this pid namespace
                    pass
            procs.append({**proc, "engine": engine, "name": name})
        out.append({**gpu, "processes": procs})
    return out


def batch_share(
    energy_j: tuple[float | None, float | None],
    engine_tokens: int,
    batch_tokens: int,
    duration_s: float,
    gpus: int,
) -> tuple[float | None, float]:
    """The batch's energy (J) and GPU-seconds: the GPUs' energy-counter delta and time over
    the batch, times the batch's share of the tokens the engine made meanwhile (batches of one
    worker overlap, so each pays for what it generated).

    None for energy when a counter is missing or went backwards (a driver reload): better no
    figure than a wrong one. A batch that generated nothing (all resumed) costs nothing.

        batch_share((1000.0, 4000.0), engine_tokens=600, batch_tokens=200, duration_s=10,
                    gpus=1)  # → (1000.0, 3.33…)
    """
    if batch_tokens <= 0 or duration_s <= 0:
        return (0.0 if None not in energy_j else None), 0.0
    share = batch_tokens / max(engine_tokens, batch_tokens)
    gpu_s = duration_s * max(gpus, 1) * share
    start, end = energy_j
    if start is None or end is None or end < start:
        return None, gpu_s
    return (end - start) * share, gpu_s
