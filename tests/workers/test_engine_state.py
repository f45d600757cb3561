"""One engine-state type: built from the supervisor's lifecycle and /server_info, carried by
the telemetry loop (with the engine's /metrics on top) into the window a worker reports."""

from __future__ import annotations

import json
from typing import Any

import pytest

from genfleet.common.settings import Settings
from genfleet.workers.observe.engine_state import (
    EngineState,
    accept_length_from_server_info,
    accept_length_judges_mtp,
    cap_limit,
    engine_state_from_server_info,
    is_hybrid,
)
from genfleet.workers.observe.sampler import Monitor
from genfleet.workers.observe.telemetry import GpuSample
from tests.support.golden import server_info as golden

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


def synthetic(
    configured: int | None, per_dp: int | None, dp: int = 1, **top: Any
) -> dict[str, Any]:
    state = {} if per_dp is None else {"effective_max_running_requests_per_dp": per_dp}
    return {"max_running_requests": configured, "dp_size": dp, "internal_states": [state], **top}


# name, /server_info, expected (enforced cap, configured cap, cap_limit)
CAP_LIMITS: list[tuple[str, dict[str, Any], tuple[int | None, int | None, str | None]]] = [
    ("recorded: as configured", golden(), (4, 4, "configured")),
    ("recorded under load", golden("server_info_busy.json"), (4, 4, "configured")),
    ("256 cut to 12 by the state pool", golden(configured=256, per_dp=12), (12, 256, "state_pool")),
    ("256 cut to 12 on a model without a state pool",
     golden(configured=256, per_dp=12, mamba=None), (12, 256, "kv")),
    ("none configured: SGLang sized it from its KV cache", synthetic(None, 300), (300, None, "kv")),
    ("none configured on a hybrid model", golden(configured=None, per_dp=40),
     (40, None, "state_pool")),
    ("a state pool size passed at top level", synthetic(256, 12, max_mamba_cache_size=12),
     (12, 256, "state_pool")),
    ("DP 3: 256 split 85 a rank is no cut", synthetic(256, 85, dp=3), (255, 256, "configured")),
    ("DP 2: 40 a rank of 256 is", synthetic(256, 40, dp=2), (80, 256, "kv")),
    ("an older engine: no enforced figure", synthetic(64, None), (64, 64, "configured")),
    ("not SGLang", {}, (None, None, None)),
]  # fmt: skip


@pytest.mark.parametrize(
    ("info", "expected"), [c[1:] for c in CAP_LIMITS], ids=[c[0] for c in CAP_LIMITS]
)
def test_what_caps_the_engine_is_read_from_server_info(
    info: dict[str, Any], expected: tuple[int | None, int | None, str | None]
) -> None:
    fields = engine_state_from_server_info(info)
    got = (
        fields.get("max_running_requests"),
        fields.get("configured_max_running_requests"),
        fields.get("cap_limit"),
    )
    assert got == expected
    assert cap_limit(info) == expected[2]
    state = EngineState.observe("ready", info)
    assert (state.max_running_requests, state.configured_max_running_requests) == expected[:2]
    assert state.cap_limit == expected[2]


def test_the_recorded_hybrid_model_has_a_state_pool() -> None:
    assert is_hybrid(golden()) and is_hybrid(golden("server_info_busy.json"))
    assert not is_hybrid(golden(mamba=None)) and not is_hybrid({})


def test_the_runtime_s_plan_travels_with_the_state() -> None:
    state = EngineState.observe(
        "ready",
        golden(configured=256, per_dp=12),
        plan_cap=48,
        plan_fix="--disable-radix-cache --max-running-requests 48",
        mtp_planned_off=True,
    )
    assert (state.plan_cap, state.plan_fix, state.mtp_planned_off) == (
        48,
        "--disable-radix-cache --max-running-requests 48",
        True,
    )
    assert EngineState.from_json(json.loads(json.dumps(state.to_json()))) == state
    plain = EngineState.observe("ready", INFO)
    assert (plain.plan_cap, plain.plan_fix, plain.mtp_planned_off) == (None, None, False)


@pytest.mark.parametrize(
    ("counts", "window_tokens"),
    [
        ([100, 200, 300], 300),
        ([96, 90, 150], 150),  # an estimate set right at an answer's end, then more streamed
        ([64, 60, 60], 64),  # set right with nothing after it: what rose, once
    ],
)
def test_the_window_takes_the_streamed_count_where_it_rises(
    counts: list[int], window_tokens: int
) -> None:
    now = [1000.0]
    tokens = [0]
    monitor = Monitor(
        Settings(enable_metrics=False),
        "w@test",
        OneGpu(),
        lambda: EngineState(up=True),
        lambda: tokens[0],
        None,
        clock=lambda: now[0],
    )
    try:
        for count in counts:
            now[0] += 1
            tokens[0] = count
            monitor.tick()
    finally:
        monitor.stop()
    assert monitor.report()["tokens"] == window_tokens
