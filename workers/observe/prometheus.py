"""A worker's Prometheus endpoint: GPU power against its limit, tokens, feeding, findings.

Flower has no GPU or queue figures, so each worker exports its own on `metrics_port`, bound
to loopback unless told otherwise (a scraper on another host needs `addr="0.0.0.0"` and a
firewall). Call `update` whenever a new window summary exists (each sample, or each beat).
"""

from __future__ import annotations

import threading
from collections.abc import Iterable, Mapping
from typing import Any
from wsgiref.simple_server import WSGIServer

from prometheus_client import CollectorRegistry, Counter, Gauge, start_http_server

from genfleet.common.quality import QualityTally
from genfleet.workers.observe.diagnosis import CAUSES, Finding
from genfleet.workers.observe.engine_state import EngineState

_GPU = ["worker", "gpu_uuid"]
_UNDERUSE_CAUSES = [c for c in CAUSES if c != "worker_unresponsive"]


class MetricsExporter:
    """The metrics of one worker in their own registry (never the process-global one).

    Gauges: genfleet_gpu_power_watts (latest reading), genfleet_gpu_power_limit_watts
    (enforced), genfleet_gpu_energy_joules (the driver's cumulative counter: use `rate()`),
    genfleet_inflight, genfleet_max_inflight (the limiter size, named like the setting),
    genfleet_accept_length, genfleet_underused{cause} (1 for the current cause of an underused
    GPU, 0 for every other cause), genfleet_answers{kind} (answers by kind, and `all`: their
    shares are kind / all). Counter: genfleet_tokens_total.
    """

    def __init__(self, worker: str, registry: CollectorRegistry | None = None) -> None:
        self.worker = worker
        self.registry = registry if registry is not None else CollectorRegistry()
        r = self.registry
        self.power = Gauge("genfleet_gpu_power_watts", "GPU power draw (W)", _GPU, registry=r)
        self.power_limit = Gauge(
            "genfleet_gpu_power_limit_watts", "Enforced GPU power limit (W)", _GPU, registry=r
        )
        self.energy = Gauge(
            "genfleet_gpu_energy_joules",
            "GPU energy counter since driver load (J)",
            _GPU,
            registry=r,
        )
        self.tokens = Counter("genfleet_tokens", "Tokens generated", ["worker"], registry=r)
        self.inflight = Gauge("genfleet_inflight", "Requests in flight", ["worker"], registry=r)
        self.max_inflight = Gauge(
            "genfleet_max_inflight", "In-flight limiter size", ["worker"], registry=r
        )
        self.accept_length = Gauge(
            "genfleet_accept_length", "Speculative decoding accept length", ["worker"], registry=r
        )
        self.underused = Gauge(
            "genfleet_underused",
            "1 when the GPU is underused while work waits, labelled with the cause",
            [*_GPU, "cause"],
            registry=r,
        )
        self.answers = Gauge(
            "genfleet_answers",
            "Answers this worker generated, by kind (common/quality.py: kept, empty, short, "
            "length, reasoning_full, stopped, error; an answer may be of several), and all",
            ["worker", "kind"],
            registry=r,
        )
        self._tokens_seen = 0
        self._server: WSGIServer | None = None
        self._thread: threading.Thread | None = None

    def start(self, port: int, addr: str = "127.0.0.1") -> int:
        """Serve /metrics on addr:port (0: any free port); returns the bound port."""
        self._server, self._thread = start_http_server(port, addr=addr, registry=self.registry)
        return int(self._server.server_port)

    def stop(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
        if self._thread is not None:
            self._thread.join(timeout=5)
        self._server = self._thread = None

    def update(
        self,
        summary: Mapping[str, Any],
        engine_state: EngineState | None = None,
        findings: Iterable[Finding] = (),
    ) -> None:
        """Set every metric from a `TelemetryWindow.summary`, the engine state (default: the
        summary's) and the findings of the last diagnosis (other workers' are ignored)."""
        w = self.worker
        for gpu in summary.get("gpus") or []:
            labels = (w, gpu["gpu_uuid"])
            self.power.labels(*labels).set(gpu.get("last_power_w", gpu["power_w"]))
            self.power_limit.labels(*labels).set(gpu["power_limit_w"])
            if gpu.get("energy_j") is not None:
                self.energy.labels(*labels).set(gpu["energy_j"])
        total = int(summary.get("tokens_total") or 0)
        self.tokens.labels(w).inc(
            total - self._tokens_seen if total >= self._tokens_seen else total
        )
        self._tokens_seen = total
        if engine_state is None and summary.get("engine"):
            engine_state = EngineState.from_json(summary["engine"])
        if engine_state is not None:
            self.inflight.labels(w).set(engine_state.inflight)
            self.max_inflight.labels(w).set(engine_state.inflight_cap)
            if engine_state.accept_length is not None:
                self.accept_length.labels(w).set(engine_state.accept_length)
        if summary.get("waste") is not None:
            tally = QualityTally.from_counters(summary["waste"])
            self.answers.labels(w, "all").set(tally.answers)
            for kind, count in tally.counts.items():
                self.answers.labels(w, kind).set(count)
        current = {
            (f.gpu_uuid, f.cause)
            for f in findings
            if f.worker == w and f.verdict == "underused" and f.gpu_uuid
        }
        for gpu in summary.get("gpus") or []:
            for cause in _UNDERUSE_CAUSES:
                flag = 1.0 if (gpu["gpu_uuid"], cause) in current else 0.0
                self.underused.labels(w, gpu["gpu_uuid"], cause).set(flag)
