"""One engine-state type: built from the supervisor's lifecycle and /server_info, carried by
the telemetry loop (with the engine's /metrics on top) into the window a worker reports."""

from __future__ import annotations

from typing import Any

import pytest

from genfleet.common.settings import Settings
from genfleet.workers.observe.engine_state import (
    EngineState,
    accept_length_from_server_info,
    accept_length_judges_mtp,
)
from genfleet.workers.observe.sampler import Monitor
from genfleet.workers.observe.telemetry import GpuSample

INFO = {
    "speculative_algorithm": "EAGLE",
    "max_running_requests": 48,
    "internal_states": [{"avg_spec_accept_length": 2.7}],
}


@pytest.mark.parametrize(
    ("lifecycle", "up", "restarting"),
    [
        ("ready", True, False),
        ("starting", False, False),
        ("restarting", False, True),
        ("exhausted", False, False),
        ("stopped", False, False),
    ],
)
def test_the_lifecycle_decides_up_and_restarting(
    lifecycle: str, up: bool, restarting: bool
) -> None:
    state = EngineState.observe(lifecycle, INFO, inflight=3, inflight_cap=64, restarts=2)
    assert (state.up, state.restarting) == (up, restarting)
    assert (state.inflight, state.inflight_cap, state.restarts) == (3, 64, 2)
    assert (state.speculative_algorithm, state.max_running_requests) == ("EAGLE", 48)
    assert state.accept_length == 2.7 and state.spec_reported
    assert EngineState.from_json(state.to_json()) == state


def test_an_engine_without_server_info_does_not_report_spec() -> None:
    state = EngineState.observe("ready", {})
    assert state.up and not state.spec_reported
    assert state.speculative_algorithm is None and state.accept_length is None


@pytest.mark.parametrize(
    ("info", "expected"),
    [
        (INFO, 2.7),
        ({"internal_states": [{"avg_spec_accept_length": 3}]}, 3.0),
        ({"internal_states": [{"avg_spec_accept_length": 0}]}, None),  # not measured yet
        ({"internal_states": [{"avg_spec_accept_length": None}]}, None),
        ({"internal_states": [{"avg_spec_accept_length": True}]}, None),
        ({"internal_states": []}, None),
        ({"internal_states": "garbage"}, None),
        ({"internal_states": ["garbage"]}, None),
        ({}, None),
    ],
)
def test_accept_length_from_server_info(info: dict[str, Any], expected: float | None) -> None:
    assert accept_length_from_server_info(info) == expected


class OneGpu:
    available = True
    reason = None

    def __init__(self) -> None:
        self.ts = 1000.0

    def sample(self) -> list[GpuSample]:
        return [
            GpuSample(
                ts=self.ts, gpu_uuid="GPU-0", gpu_name="H200", power_w=500.0, power_limit_w=700.0
            )
        ]


def test_the_monitor_reports_the_runtimes_engine_state_and_tokens() -> None:
    now = [1000.0]
    tokens = [0]
    lifecycle = ["ready"]
    settings = Settings(enable_metrics=False)
    monitor = Monitor(
        settings,
        "w@test",
        OneGpu(),
        lambda: EngineState.observe(lifecycle[0], INFO, inflight=5, inflight_cap=64, restarts=1),
        lambda: tokens[0],
        None,
        clock=lambda: now[0],
    )
    monitor.batch_started("r")
    tokens[0] = 900
    try:
        monitor.tick()
    finally:
        monitor.stop()  # not started: closes its HTTP client; tick() still works

    report = monitor.report()
    engine = EngineState.from_json(report["engine"])
    assert engine.up and engine.inflight == 5 and engine.restarts == 1
    assert (engine.active_batches, engine.runs) == (1, ["r"])
    assert report["tokens_total"] == 900
    assert not report["engine_down_in_window"]

    lifecycle[0] = "restarting"
    monitor.batch_finished("r")
    now[0] += 1
    monitor.tick()
    report = monitor.report()
    assert report["engine"]["restarting"] and report["engine_down_in_window"]
    assert report["engine"]["runs"] == [] and report["tokens_total"] == 900


@pytest.mark.parametrize(
    ("adaptive", "running", "judged"),
    [(False, 200, True), (False, None, True), (True, 4, True), (True, 8, False),
     (True, 64, False), (True, None, False)],
)  # fmt: skip
def test_adaptive_accept_length_is_judged_only_where_sglang_always_drafts(
    adaptive: bool, running: int | None, judged: bool
) -> None:
    info = {"speculative_algorithm": "EAGLE", "speculative_adaptive": adaptive}
    state = EngineState.observe("ready", info)
    assert state.speculative_adaptive is adaptive
    assert accept_length_judges_mtp(state.speculative_adaptive, running) is judged
