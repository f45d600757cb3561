"""The Prometheus exporter, scraped over real HTTP on a free loopback port."""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from genfleet.common.quality import QualityTally
from genfleet.workers.observe.diagnosis import Finding
from genfleet.workers.observe.engine_state import EngineState
from genfleet.workers.observe.prometheus import MetricsExporter
from genfleet.workers.observe.telemetry import GpuSample, TelemetryWindow

NOW = 1_760_000_000.0
UUID = "GPU-0a1b2c3d-0000-0000-0000-000000000001"


@pytest.fixture
def exporter() -> Iterator[tuple[MetricsExporter, str]]:
    exp = MetricsExporter("gpu0@node1")
    port = exp.start(0)
    try:
        yield exp, f"http://127.0.0.1:{port}/metrics"
    finally:
        exp.stop()


def scrape(url: str) -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
    text = httpx.get(url, timeout=5).text
    return {
        (s.name, frozenset(s.labels.items())): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def summary(tokens: int, power_w: float = 400.0) -> dict[str, object]:
    window = TelemetryWindow(60.0)
    for k in range(3):
        window.add(
            [
                GpuSample(
                    NOW - 2 + k, UUID, "NVIDIA H200", power_w, 600.0, energy_j=1e6 + k * power_w
                )
            ]
        )
    window.add_tokens(tokens, NOW)
    window.add_engine(
        EngineState(up=True, inflight=2, inflight_cap=64, speculative_algorithm=None), NOW
    )
    return window.summary(NOW)


def underused(cause: str, worker: str = "gpu0@node1") -> Finding:
    return Finding(worker, UUID, "underused", cause, {}, "raise it", NOW)


def test_update_then_scrape(exporter: tuple[MetricsExporter, str]) -> None:
    exp, url = exporter
    state = EngineState(up=True, inflight=12, inflight_cap=64, accept_length=2.4)
    exp.update(
        summary(tokens=900), state, [underused("client_limited"), underused("mtp_off", "w9")]
    )
    values = scrape(url)
    gpu = frozenset({("worker", "gpu0@node1"), ("gpu_uuid", UUID)})
    worker = frozenset({("worker", "gpu0@node1")})
    assert values[("genfleet_gpu_power_watts", gpu)] == 400.0
    assert values[("genfleet_gpu_power_limit_watts", gpu)] == 600.0
    assert values[("genfleet_gpu_energy_joules", gpu)] == 1e6 + 800.0
    assert values[("genfleet_tokens_total", worker)] == 900.0
    assert values[("genfleet_inflight", worker)] == 12.0
    assert values[("genfleet_max_inflight", worker)] == 64.0
    assert values[("genfleet_accept_length", worker)] == 2.4
    assert values[("genfleet_underused", gpu | {("cause", "client_limited")})] == 1.0
    assert values[("genfleet_underused", gpu | {("cause", "mtp_off")})] == 0.0

    exp.update(summary(tokens=1500), None, [])  # engine state from the summary; cause cleared
    values = scrape(url)
    assert values[("genfleet_tokens_total", worker)] == 1500.0
    assert values[("genfleet_inflight", worker)] == 2.0
    assert values[("genfleet_underused", gpu | {("cause", "client_limited")})] == 0.0


def test_binds_loopback_by_default(exporter: tuple[MetricsExporter, str]) -> None:
    exp, _ = exporter
    assert exp._server is not None
    assert exp._server.server_address[0] == "127.0.0.1"


def test_own_registry_per_exporter() -> None:
    a, b = MetricsExporter("a"), MetricsExporter("b")  # no duplicate-timeseries error
    assert a.registry is not b.registry


def test_answers_by_kind_from_the_workers_quality_counters(
    exporter: tuple[MetricsExporter, str],
) -> None:
    exp, url = exporter
    tally = QualityTally()
    for _ in range(3):
        tally.add({"content": "", "finish_reason": "length", "usage": {"reasoning_tokens": 64}})
    tally.add({"content": "an answer long enough for a trainer to keep.", "finish_reason": "stop"})
    exp.update({**summary(tokens=10), "waste": {"waste_kept_records": 1, **tally.to_counters()}})
    values = scrape(url)

    def answers(kind: str) -> float:
        return values[("genfleet_answers", frozenset({("worker", "gpu0@node1"), ("kind", kind)}))]

    assert answers("all") == 4.0
    assert answers("kept") == 1.0
    assert answers("empty") == answers("length") == answers("reasoning_full") == 3.0
    assert answers("error") == 0.0
