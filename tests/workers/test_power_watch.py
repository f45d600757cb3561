"""diagnose() and dedupe() as tables, on windows built from recorded-looking H200 samples.

Figures measured on an H200 (700 W limit): idle 79 W, memory-bound GEMV 527 W while NVML
read 98 % utilisation, compute-bound matmul 690 W. The 400 W of a 600 W limit is the run
this product is modelled on (MTP was off).
"""

from __future__ import annotations

import json
from typing import Any

import pytest

from genfleet.workers.observe.diagnosis import (
    CAUSES,
    EngineRoom,
    Finding,
    FleetState,
    dedupe,
    diagnose,
    verdicts,
)
from genfleet.workers.observe.engine_state import (
    EngineState,
    enforced_cap,
    engine_state_from_server_info,
)
from genfleet.workers.observe.telemetry import GpuSample, TelemetryWindow
from tests.support.golden import server_info as golden

NOW = 1_760_000_000.0
WINDOW_S = 60.0

SATURATED: dict[str, Any] = {
    "up": True,
    "inflight": 64,
    "inflight_cap": 64,
    "running": 48,
    "max_running_requests": 48,
    "queued": 4,
    "speculative_algorithm": "EAGLE",
    "accept_length": 2.6,
    "active_batches": 3,
    "runs": ["run-a"],
}


def recorded(
    power_w: float,
    limit_w: float = 700.0,
    *,
    uuid: str = "GPU-0a1b2c3d-0000-0000-0000-000000000001",
    jitter_w: float = 0.0,
    engine_down_earlier: bool = False,
    **engine: Any,
) -> dict[str, Any]:
    """A worker's summary after a minute at `power_w` mean: 1 Hz readings that jitter around
    the mean while the energy counter integrates the mean exactly, as NVML's does."""
    window = TelemetryWindow(WINDOW_S)
    energy0 = 9.1e7
    for k in range(61):
        ts = NOW - 60 + k
        window.add(
            [
                GpuSample(
                    ts=ts,
                    gpu_uuid=uuid,
                    gpu_name="NVIDIA H200",
                    power_w=power_w + (jitter_w if k % 2 else -jitter_w),
                    power_limit_w=limit_w,
                    default_power_limit_w=limit_w,
                    utilization_pct=98.0,
                    memory_used_mib=120_000.0,
                    memory_total_mib=143_771.0,
                    sm_clock_mhz=1980.0,
                    temperature_c=55.0,
                    energy_j=energy0 + power_w * k,
                )
            ]
        )
        window.add_tokens(500, ts)
    state = EngineState.from_json({**SATURATED, **engine})
    if engine_down_earlier:
        window.add_engine(EngineState(up=False, restarting=True), NOW - 30)
    window.add_engine(state, NOW - 1)
    return window.summary(NOW)


def fleet(
    queue_depth: int = 5,
    workers: tuple[str, ...] = ("w1",),
    staging: dict[str, float] | None = None,
    pending: int | None = None,
) -> FleetState:
    return FleetState(
        queue_depth=queue_depth,
        pending_batches={
            "run-a": (queue_depth and queue_depth + 3) if pending is None else pending
        },
        expected_workers=frozenset(workers),
        staging=staging or {},
    )


IDLE_ENGINE: dict[str, Any] = {
    "inflight": 0,
    "running": 0,
    "queued": 0,
    "active_batches": 0,
    "runs": [],
}
FEW_INFLIGHT: dict[str, Any] = {"inflight": 2, "running": 2, "queued": 0, "active_batches": 1}

# name, power W, limit W, engine overrides, queue depth, expected (verdict, cause)
CASES: list[tuple[str, float, float, dict[str, Any], int, tuple[str, str | None]]] = [
    ("compute-bound saturated, MTP on", 690, 700, {}, 10, ("ok", None)),
    ("memory-bound 527 W is above 0.70", 527, 700, {}, 10, ("ok", None)),
    ("exactly at the threshold", 490, 700, FEW_INFLIGHT, 5, ("ok", None)),
    ("just below the threshold", 489, 700, FEW_INFLIGHT, 5, ("underused", "client_limited")),
    (
        "400 W of 600 W, MTP off",
        400,
        600,
        {"speculative_algorithm": None, "accept_length": None, **FEW_INFLIGHT},
        5,
        ("underused", "mtp_off"),
    ),
    (
        "400 W of 600 W, MTP off, at its cap with work queued inside: the cap, not MTP",
        400,
        600,
        {"speculative_algorithm": None, "accept_length": None},
        5,
        ("underused", "engine_capped"),
    ),
    (
        "MTP off as the engine plan chose: not blamed",
        400,
        600,
        {"speculative_algorithm": None, "accept_length": None, "mtp_planned_off": True,
         **FEW_INFLIGHT},
        5,
        ("underused", "client_limited"),
    ),
    ("idle, nothing waits", 79, 700, IDLE_ENGINE, 0, ("idle", None)),
    ("tail of a run: queue empty, staging done", 79, 700, FEW_INFLIGHT, 0, ("draining", None)),
    (
        "tail of a run with MTP off: draining, not MTP",
        79,
        700,
        {"speculative_algorithm": None, "accept_length": None, **FEW_INFLIGHT},
        0,
        ("draining", None),
    ),
    (
        "queue empty but the client's limiter is full: client-limited",
        128,
        700,
        {"inflight": 64, "inflight_cap": 64, "running": None, "queued": None},
        0,
        ("underused", "client_limited"),
    ),
    ("engine down", 79, 700, {"up": False, **IDLE_ENGINE}, 5, ("underused", "engine_down")),
    ("engine restarting", 79, 700, {"restarting": True}, 5, ("underused", "engine_down")),
    (
        "down beats MTP off",
        79,
        700,
        {"up": False, "speculative_algorithm": None},
        5,
        ("underused", "engine_down"),
    ),
    (
        "a command engine that cannot report MTP is not blamed for it",
        134,
        700,
        {
            "speculative_algorithm": None,
            "accept_length": None,
            "spec_reported": False,
            **FEW_INFLIGHT,
        },
        5,
        ("underused", "client_limited"),
    ),
    (
        "MTP off beats client-limited",
        134,
        700,
        {"speculative_algorithm": None, "accept_length": None, **FEW_INFLIGHT},
        5,
        ("underused", "mtp_off"),
    ),
    (
        "MTP ineffective beats engine capped",
        400,
        700,
        {"accept_length": 1.0, "running": 48, "queued": 30},
        5,
        ("underused", "mtp_ineffective"),
    ),
    (
        "MTP ineffective at good power",
        690,
        700,
        {"accept_length": 1.0},
        5,
        ("mtp_ineffective",) * 2,
    ),
    (
        "MTP ineffective while idle",
        79,
        700,
        {"accept_length": 1.02, **IDLE_ENGINE},
        0,
        ("mtp_ineffective", "mtp_ineffective"),
    ),
    ("accept length at the minimum is fine", 690, 700, {"accept_length": 1.2}, 5, ("ok", None)),
    (
        "adaptive MTP stops drafting at 64 running: 1.0 is its choice",
        690,
        700,
        {"accept_length": 1.0, "speculative_adaptive": True, "running": 64},
        5,
        ("ok", None),
    ),
    (
        "adaptive MTP drafts below 8 running: 1.0 there is broken MTP",
        690,
        700,
        {"accept_length": 1.0, "speculative_adaptive": True, "running": 4},
        5,
        ("mtp_ineffective",) * 2,
    ),
    (
        "accept length not measured yet",
        300,
        700,
        {"accept_length": None, **FEW_INFLIGHT},
        5,
        ("underused", "client_limited"),
    ),
    (
        "engine capped",
        420,
        700,
        {"running": 48, "max_running_requests": 48, "queued": 16},
        5,
        ("underused", "engine_capped"),
    ),
    (
        "engine at its cap, nothing queued inside, more in flight: the cap, not the limiter",
        420,
        700,
        {"running": 48, "queued": 0},
        5,
        ("underused", "engine_capped"),
    ),
    (
        "engine at its cap, as many in flight, orders queued: the cap",
        420,
        700,
        {"running": 48, "queued": 0, "inflight": 48, "inflight_cap": 48},
        5,
        ("underused", "engine_capped"),
    ),
    (
        "engine has room, limiter full: the limiter",
        420,
        700,
        {"running": 40, "queued": 0, "inflight": 40, "inflight_cap": 40},
        0,
        ("underused", "client_limited"),
    ),
    (
        "engine has room, orders queued: the limiter",
        420,
        700,
        {"running": 20, "queued": 0, "inflight": 20, "inflight_cap": 64},
        5,
        ("underused", "client_limited"),
    ),
    (
        "engine has room, its queue not reported: the limiter",
        420,
        700,
        {"running": 20, "queued": None, "inflight": 64, "inflight_cap": 64},
        5,
        ("underused", "client_limited"),
    ),
    (
        "limiter full, requests queued below the engine's cap: the KV cache, not the limiter",
        420,
        700,
        {"running": 30, "queued": 9},
        5,
        ("underused", "engine_capped"),
    ),
    (
        "engine capped beats starved",
        420,
        700,
        {"running": 48, "queued": 16},
        0,
        ("underused", "engine_capped"),
    ),
    ("a crash loop while work waits", 79, 700, {"up": False, **IDLE_ENGINE,
     "crash": {"error": "RuntimeError: x", "repeats": 3, "loop": True}}, 5,
     ("underused", "crash_loop")),
    ("a crash loop is named with nothing queued", 79, 700, {"up": False, **IDLE_ENGINE,
     "crash": {"error": "RuntimeError: x", "repeats": 3, "loop": True}}, 0,
     ("idle", "crash_loop")),
    ("the restart budget spent, work waits", 79, 700, {"up": False, "exhausted": True,
     **IDLE_ENGINE}, 5, ("underused", "restart_budget_spent")),
    ("a crash loop beats its spent budget", 79, 700, {"up": False, "exhausted": True,
     **IDLE_ENGINE, "crash": {"error": "E: y", "repeats": 5, "loop": True}}, 5,
     ("underused", "crash_loop")),
    ("flaky deaths are no crash loop: engine down", 79, 700, {"up": False, "restarting": True,
     **FEW_INFLIGHT, "crash": {"error": "E: y", "repeats": 1, "loop": False}}, 5,
     ("underused", "engine_down")),
]  # fmt: skip


CUDA_GRAPH_CRASH = {
    "error": "RuntimeError: The expanded size of the tensor (33554432) must match the "
    "existing size (33558528) at non-singleton dimension 0",
    "repeats": 5,
    "loop": True,
    "known": "sglang_cuda_graph_verify_buffers",
    "what": "SGLang crashes once the running batch reaches its largest captured CUDA graph",
    "workaround": "--disable-cuda-graph avoids it",
}


def test_engine_alarms_name_the_error_and_the_fix() -> None:
    from genfleet.workers.observe.headlines import finding_line, watch_headlines

    looping = recorded(79, up=False, exhausted=True, cooldown_left_s=540.0,
                       restarts_in_window=5, restart_budget=5, restart_window_s=3600.0,
                       crash=CUDA_GRAPH_CRASH, **IDLE_ENGINE)  # fmt: skip
    (finding,) = diagnose({"w1": looping}, fleet(3), NOW)
    assert finding.cause == "crash_loop"
    assert CUDA_GRAPH_CRASH["error"] in finding.suggestion
    assert "--disable-cuda-graph" in finding.suggestion and "5 times" in finding.suggestion
    (row,) = verdicts({"w1": looping}, fleet(3), NOW)
    assert row["why"] == finding.suggestion  # what `top` prints under its table
    line = finding_line(finding.to_json())
    assert "crash loop" in line and "--disable-cuda-graph" in line and "33554432" in line
    assert "crash_loop" in watch_headlines([row], [finding.to_json()]).splitlines()[0]

    spent = recorded(79, up=False, exhausted=True, cooldown_left_s=540.0,
                     restarts_in_window=5, restart_budget=5, restart_window_s=3600.0,
                     crash={"error": "ValueError: flaky", "repeats": 1, "loop": False},
                     **IDLE_ENGINE)  # fmt: skip
    (finding,) = diagnose({"w1": spent}, fleet(3), NOW)
    assert finding.cause == "restart_budget_spent"
    assert "540 s" in finding.suggestion and "5 restarts in 3600 s" in finding.suggestion
    line = finding_line(finding.to_json())
    assert "restart budget spent (5 in 3600 s), back in 540 s: ValueError: flaky" in line


@pytest.mark.parametrize(
    ("power_w", "limit_w", "engine", "queue_depth", "expected"),
    [case[1:] for case in CASES],
    ids=[case[0] for case in CASES],
)
def test_diagnose_table(
    power_w: float,
    limit_w: float,
    engine: dict[str, Any],
    queue_depth: int,
    expected: tuple[str, str | None],
) -> None:
    samples = {"w1": recorded(power_w, limit_w, jitter_w=25.0, **engine)}
    rows = verdicts(samples, fleet(queue_depth), NOW)
    findings = diagnose(samples, fleet(queue_depth), NOW)
    assert [(r["verdict"], r["cause"]) for r in rows] == [expected]
    if expected[1] is None:
        assert findings == []
    else:
        (finding,) = findings
        assert (finding.verdict, finding.cause) == expected
        assert finding.numbers["power_w"] == pytest.approx(power_w)
        assert finding.numbers["power_limit_w"] == limit_w
        assert finding.numbers["queue_depth"] == queue_depth
        assert finding.suggestion and "\n" not in finding.suggestion


def test_threshold_is_a_parameter() -> None:
    samples = {"w1": recorded(527, **FEW_INFLIGHT)}
    assert diagnose(samples, fleet(), NOW) == []
    (finding,) = diagnose(samples, fleet(), NOW, threshold=0.80)
    assert finding.cause == "client_limited"
    assert finding.numbers["threshold"] == 0.80
    assert finding.numbers["share_of_limit"] == pytest.approx(527 / 700)


def test_min_accept_length_is_a_parameter() -> None:
    samples = {"w1": recorded(690, accept_length=1.5)}
    assert diagnose(samples, fleet(), NOW) == []
    (finding,) = diagnose(samples, fleet(), NOW, min_accept_length=1.8)
    assert finding.verdict == "mtp_ineffective"
    assert "1.50 < 1.8" in finding.suggestion


def test_restart_during_the_window_explains_low_power() -> None:
    samples = {"w1": recorded(300, engine_down_earlier=True, **FEW_INFLIGHT)}
    (finding,) = diagnose(samples, fleet(), NOW)
    assert finding.cause == "engine_down"


def test_findings_carry_numbers_run_and_other_causes() -> None:
    engine = {"speculative_algorithm": None, "accept_length": None, **FEW_INFLIGHT}
    (finding,) = diagnose({"w1": recorded(400, 600, **engine)}, fleet(), NOW)
    assert finding.run == "run-a"
    assert finding.ts == NOW
    assert finding.numbers["other_causes"] == ["client_limited"]
    assert finding.numbers["share_of_limit"] == pytest.approx(400 / 600)
    assert (finding.numbers["inflight"], finding.numbers["inflight_cap"]) == (2, 64)
    assert finding.fingerprint() == f"w1|{finding.gpu_uuid}|mtp_off"
    data = json.loads(json.dumps(finding.to_json()))
    assert Finding.from_json(data) == finding


def test_one_finding_per_underused_gpu_of_a_worker() -> None:
    hot = recorded(690, uuid="GPU-hot", **FEW_INFLIGHT)
    cold = recorded(200, uuid="GPU-cold", **FEW_INFLIGHT)
    both = {**hot, "gpus": hot["gpus"] + cold["gpus"]}
    findings = diagnose({"w1": both}, fleet(), NOW)
    assert [(f.gpu_uuid, f.cause) for f in findings] == [("GPU-cold", "client_limited")]
    assert [r["verdict"] for r in verdicts({"w1": both}, fleet(), NOW)] == ["ok", "underused"]


def test_missing_worker_is_unresponsive() -> None:
    samples = {"w1": recorded(690)}
    (finding,) = diagnose(samples, fleet(workers=("w1", "w2")), NOW)
    assert (finding.worker, finding.verdict, finding.cause) == (
        "w2",
        "unresponsive",
        "worker_unresponsive",
    )


@pytest.mark.parametrize(("age_s", "stale"), [(90.0, False), (90.5, True), (600.0, True)])
def test_stale_summary_is_unresponsive(age_s: float, stale: bool) -> None:
    summary = recorded(690)
    findings = diagnose({"w1": summary}, fleet(), NOW + age_s, stale_after_s=90.0)
    assert [f.cause for f in findings] == (["worker_unresponsive"] if stale else [])
    if stale:
        assert findings[0].numbers["summary_age_s"] == pytest.approx(age_s)


def test_worker_without_gpu_telemetry_is_judged_on_its_engine() -> None:
    down = {**recorded(79, up=False), "gpus": [], "telemetry_available": False}
    up = {**recorded(79), "gpus": [], "telemetry_available": False}
    (finding,) = diagnose({"w1": down}, fleet(), NOW)
    assert (finding.gpu_uuid, finding.cause) == (None, "engine_down")
    assert diagnose({"w1": up}, fleet(), NOW) == []
    assert verdicts({"w1": up}, fleet(), NOW)[0]["verdict"] == "unknown"


def test_fleet_state_as_json_and_top_rows() -> None:
    state = fleet().to_json()
    samples = {"w1": recorded(690)}
    (row,) = verdicts(samples, json.loads(json.dumps(state)), NOW)
    assert set(row) == {
        "worker",
        "gpu_uuid",
        "gpu_name",
        "power_w",
        "power_limit_w",
        "tokens_per_s",
        "inflight",
        "inflight_cap",
        "accept_length",
        "j_per_token",
        "verdict",
        "cause",
    }
    assert row["tokens_per_s"] == pytest.approx(500.0)  # (now - 60, now]: 60 s of 500 tok
    assert row["j_per_token"] == pytest.approx(690 / 500)
    json.dumps(row)


def finding(cause: str, gpu: str = "GPU-a", worker: str = "w1") -> Finding:
    verdict = "unresponsive" if cause == "worker_unresponsive" else "underused"
    return Finding(worker, gpu, verdict, cause, {}, "do something", NOW)


def test_dedupe_does_not_alert_twice() -> None:
    new, alerted = dedupe([finding("mtp_off")], {}, NOW, realert_after_s=1800)
    assert [f.cause for f in new] == ["mtp_off"]
    again, alerted2 = dedupe([finding("mtp_off")], alerted, NOW + 30, realert_after_s=1800)
    assert again == []
    assert alerted2 == {"w1|GPU-a|mtp_off": NOW}


def test_dedupe_realerts_after_quiet_period() -> None:
    _, alerted = dedupe([finding("starved")], {}, NOW, realert_after_s=1800)
    quiet, alerted = dedupe([finding("starved")], alerted, NOW + 1799, realert_after_s=1800)
    assert quiet == []
    loud, alerted = dedupe([finding("starved")], alerted, NOW + 1800, realert_after_s=1800)
    assert [f.cause for f in loud] == ["starved"]
    assert alerted["w1|GPU-a|starved"] == NOW + 1800


def test_dedupe_alerts_on_cause_change_and_back() -> None:
    _, alerted = dedupe([finding("client_limited")], {}, NOW, realert_after_s=1800)
    new, alerted = dedupe([finding("engine_capped")], alerted, NOW + 30, realert_after_s=1800)
    assert [f.cause for f in new] == ["engine_capped"]
    assert set(alerted) == {"w1|GPU-a|engine_capped"}
    back, _ = dedupe([finding("client_limited")], alerted, NOW + 60, realert_after_s=1800)
    assert [f.cause for f in back] == ["client_limited"]


def test_dedupe_keeps_other_gpus_and_workers_apart() -> None:
    batch = [finding("mtp_off", "GPU-a"), finding("mtp_off", "GPU-b"), finding("mtp_off", "GPU-a")]
    new, alerted = dedupe(batch, {"w2|-|worker_unresponsive": NOW - 10}, NOW, 1800)
    assert [f.gpu_uuid for f in new] == ["GPU-a", "GPU-b"]
    assert set(alerted) == {"w1|GPU-a|mtp_off", "w1|GPU-b|mtp_off", "w2|-|worker_unresponsive"}


def test_every_cause_has_a_suggestion() -> None:
    from genfleet.workers.observe.diagnosis import _SUGGESTIONS

    assert set(_SUGGESTIONS) == set(CAUSES)


def server_info(configured: int, per_dp: int | None, dp: int = 1) -> dict[str, Any]:
    """SGLang's /server_info: the configured cap at top level, the enforced one per DP rank."""
    state: dict[str, Any] = {"avg_spec_accept_length": 2.6}
    if per_dp is not None:
        state["effective_max_running_requests_per_dp"] = per_dp
    return {
        "speculative_algorithm": "EAGLE",
        "max_running_requests": configured,
        "dp_size": dp,
        "internal_states": [state] * dp,
    }


@pytest.mark.parametrize(
    ("info", "cap"),
    [
        (server_info(256, 40), 40),  # the mamba pool of a Qwen3.5 model holds 40
        (server_info(256, 40, dp=2), 80),
        (server_info(256, None), 256),  # an older engine: the configured figure
        ({"internal_states": [{}]}, None),  # not SGLang
        (server_info(256, 0), 256),
    ],
)
def test_the_enforced_cap_is_read_from_internal_states(
    info: dict[str, Any], cap: int | None
) -> None:
    assert enforced_cap(info) == cap
    assert engine_state_from_server_info(info).get("max_running_requests") == cap


def test_engine_capped_fires_at_the_enforced_cap_below_the_configured_one() -> None:
    engine = {**engine_state_from_server_info(server_info(256, 40)), "running": 40, "queued": 25}
    samples = {"w1": recorded(430, **engine)}
    (finding,) = diagnose(samples, fleet(5), NOW)
    assert finding.cause == "engine_capped"
    assert finding.numbers["max_running_requests"] == 40
    assert finding.numbers["configured_max_running_requests"] == 256
    assert finding.numbers["cap_limit"] == "kv"  # no state pool in that /server_info


# The measurement this models: SGLang on an H100 cut the configured 256 to 12 running
# requests (the recurrent-state pool of a 27B hybrid model), 5–9 requests queued inside it,
# the worker's limiter full, MTP off, 68.6 % of the power limit.
STATE_POOL_12: dict[str, Any] = {
    "running": 12,
    "max_running_requests": 12,
    "configured_max_running_requests": 256,
    "cap_limit": "state_pool",
    "queued": 7,
    "inflight": 19,
    "inflight_cap": 19,
    "speculative_algorithm": None,
    "accept_length": None,
}
PLAN_FIX = "--disable-radix-cache --max-running-requests 48"
KV_40 = {**STATE_POOL_12, "cap_limit": "kv", "running": 40, "max_running_requests": 40}
CONFIGURED_48 = {**STATE_POOL_12, "cap_limit": "configured", "running": 48,
                 "max_running_requests": 48, "configured_max_running_requests": 48}  # fmt: skip

# name, W of 700, engine overrides, queue depth, expected (verdict, cause, cap_limit), words
# the suggestion holds, words it must not hold
CAPPED: list[tuple[str, float, dict[str, Any], int, tuple[str, str | None, str | None],
                   list[str], list[str]]] = [
    ("cap 12 by the state pool, 7 queued, 68.6 %: the pool, not MTP or the limiter", 480,
     STATE_POOL_12, 5, ("underused", "engine_capped", "state_pool"),
     ["recurrent-state pool limits the engine to 12 running requests (256 configured)",
      "7 queued inside it", "--disable-radix-cache", "--mamba-full-memory-ratio"],
     ["the plan expects"]),
    ("the same with its queue empty: its limiter still waits", 480, STATE_POOL_12, 0,
     ("underused", "engine_capped", "state_pool"), ["7 queued inside it"], []),
    ("at the plan's cap: the best this card does", 480, {**STATE_POOL_12, "plan_cap": 12}, 5,
     ("ok", None, None), [], []),
    ("above the plan's cap", 300, {**STATE_POOL_12, "plan_cap": 8}, 5, ("ok", None, None), [],
     []),
    ("below the plan's cap: the plan's fix", 480,
     {**STATE_POOL_12, "plan_cap": 48, "plan_fix": PLAN_FIX}, 5,
     ("underused", "engine_capped", "state_pool"),
     [PLAN_FIX, "the plan expects 48 on this card"], ["--mamba-full-memory-ratio"]),
    ("below the plan's cap, no plan fix: the pool's", 480, {**STATE_POOL_12, "plan_cap": 48}, 5,
     ("underused", "engine_capped", "state_pool"),
     ["--mamba-full-memory-ratio", "the plan expects 48"], []),
    ("cut to 40 by the KV cache", 480, KV_40, 5, ("underused", "engine_capped", "kv"),
     ["KV cache holds only 40 running requests", "--kv-cache-dtype fp8_e4m3",
      "--mem-fraction-static"], []),
    ("as configured, the plan expects more", 480, {**CONFIGURED_48, "plan_cap": 64}, 5,
     ("underused", "engine_capped", "configured"), ["raise --max-running-requests to 64"], []),
    ("as configured, the plan's fix", 480,
     {**CONFIGURED_48, "plan_cap": 64, "plan_fix": "--max-running-requests 64"}, 5,
     ("underused", "engine_capped", "configured"), ["--max-running-requests 64"], []),
    ("as configured, no plan", 480, CONFIGURED_48, 5,
     ("underused", "engine_capped", "configured"), ["raise --max-running-requests"], [" to "]),
    ("queued below its cap: the KV cache admits no more", 480,
     {**CONFIGURED_48, "running": 30, "queued": 9, "plan_cap": 48}, 5,
     ("underused", "engine_capped", "kv"),
     ["admits no more: 30 running, below the engine's cap of 48, 9 queued inside it",
      "--kv-cache-dtype fp8_e4m3"], ["the plan expects"]),
    ("at good power the cap is no finding", 600, STATE_POOL_12, 5, ("ok", None, None), [], []),
    # The H200's old default: 48 running of a plan of 256, 584 W (83 % of 700).
    ("at good power below the plan's cap: the plan, not the power, tells", 584,
     {**CONFIGURED_48, "cap_limit": "state_pool", "configured_max_running_requests": 256,
      "plan_cap": 256, "plan_fix": "--disable-radix-cache --max-running-requests 256"}, 5,
     ("underused", "engine_capped", "state_pool"),
     ["limits the engine to 48 running requests (256 configured)",
      "the plan expects 256 on this card", "--disable-radix-cache --max-running-requests 256"],
     []),
    ("at the power limit below the plan's cap: still the plan's fix", 699,
     {**STATE_POOL_12, "plan_cap": 48, "plan_fix": PLAN_FIX}, 0,
     ("underused", "engine_capped", "state_pool"), [PLAN_FIX], []),
    ("at good power at the plan's cap", 600, {**STATE_POOL_12, "plan_cap": 12}, 5,
     ("ok", None, None), [], []),
    ("at good power below the plan's cap with room: no cap finding", 600,
     {**STATE_POOL_12, "running": 6, "queued": 0, "inflight": 6, "plan_cap": 48}, 0,
     ("ok", None, None), [], []),
]  # fmt: skip


@pytest.mark.parametrize(
    ("power_w", "engine", "queue_depth", "expected", "says", "never"),
    [c[1:] for c in CAPPED],
    ids=[c[0] for c in CAPPED],
)
def test_engine_capped_names_what_caps_it_and_its_fix(
    power_w: float,
    engine: dict[str, Any],
    queue_depth: int,
    expected: tuple[str, str | None, str | None],
    says: list[str],
    never: list[str],
) -> None:
    samples = {"w1": recorded(power_w, **engine)}
    (row,) = verdicts(samples, fleet(queue_depth), NOW)
    findings = diagnose(samples, fleet(queue_depth), NOW)
    assert (row["verdict"], row["cause"]) == expected[:2]
    if expected[1] is None:
        assert findings == []
        return
    (finding,) = findings
    assert finding.numbers["cap_limit"] == expected[2]
    assert finding.numbers["configured_max_running_requests"] == engine.get(
        "configured_max_running_requests"
    )
    assert finding.numbers["plan_cap"] == engine.get("plan_cap")
    # the cap is the limit: neither MTP nor the worker's limiter is blamed beside it
    assert not {"mtp_off", "client_limited"} & set(finding.numbers["other_causes"])
    for words in says:
        assert words in finding.suggestion
    for words in never:
        assert words not in finding.suggestion
    assert "\n" not in finding.suggestion


# name, engine figures, the client wants to send more → (full, capped, below_cap, room, at_plan,
# short_of_plan)
ROOMS: list[tuple[str, dict[str, Any], bool, tuple[bool, bool, bool, bool, bool, bool]]] = [
    ("below its cap, nothing queued", {"running": 20, "max_running_requests": 48, "queued": 0},
     True, (False, False, False, True, False, False)),
    ("at its cap, requests queued inside", {"running": 48, "max_running_requests": 48,
     "queued": 3}, False, (True, True, False, False, False, False)),
    ("at its cap, more in flight than running", {"running": 48, "max_running_requests": 48,
     "queued": 0, "inflight": 60}, False, (True, True, False, False, False, False)),
    ("at its cap, the client would send more", {"running": 48, "max_running_requests": 48,
     "queued": 0, "inflight": 48}, True, (True, True, False, False, False, False)),
    ("at its cap, nothing waits", {"running": 48, "max_running_requests": 48, "queued": 0,
     "inflight": 48}, False, (True, False, False, False, False, False)),
    ("queuing below its cap", {"running": 30, "max_running_requests": 48, "queued": 9}, True,
     (False, True, True, False, False, False)),
    ("its queue not reported", {"running": 30, "max_running_requests": 48, "queued": None},
     True, (False, False, False, True, False, False)),
    ("nothing reported", {}, True, (False, False, False, True, False, False)),
    ("at the plan's cap", {"running": 12, "max_running_requests": 12, "queued": 7,
     "plan_cap": 12}, True, (True, True, False, False, True, False)),
    ("at a cap below the plan's", {"running": 12, "max_running_requests": 12, "queued": 7,
     "plan_cap": 48}, True, (True, True, False, False, False, True)),
    ("below the plan's cap with room", {"running": 5, "max_running_requests": 12,
     "queued": 0, "plan_cap": 12}, True, (False, False, False, True, False, False)),
]  # fmt: skip


@pytest.mark.parametrize(
    ("engine", "wants_more", "expected"), [c[1:] for c in ROOMS], ids=[c[0] for c in ROOMS]
)
def test_where_the_engine_stands_against_its_cap(
    engine: dict[str, Any], wants_more: bool, expected: tuple[bool, bool, bool, bool, bool, bool]
) -> None:
    room = EngineRoom.of(engine, wants_more)
    got = (room.full, room.capped, room.below_cap, room.room, room.at_plan, room.short_of_plan)
    assert got == expected


def test_the_measured_state_pool_cap_from_server_info() -> None:
    """/server_info as SGLang 0.5.15 recorded it, the cap cut from 256 to 12."""
    info = engine_state_from_server_info(golden(configured=256, per_dp=12))
    engine = {**info, "running": 12, "queued": 7, "inflight": 19, "inflight_cap": 19,
              "speculative_algorithm": None, "accept_length": None}  # fmt: skip
    (finding,) = diagnose({"w1": recorded(480, **engine)}, fleet(5), NOW)
    assert finding.cause == "engine_capped"
    assert finding.numbers["cap_limit"] == "state_pool"
    assert (finding.numbers["max_running_requests"], finding.numbers["queued"]) == (12, 7)
    assert finding.numbers["other_causes"] == []


# name, this GPU's engine, run-a staging since (s before NOW), the other worker's unsent
# prompts, expected (verdict, cause) — all with an empty queue and 79 W of 700 W
TAIL_CASES: list[tuple[str, dict[str, Any], float | None, int, tuple[str, str | None]]] = [
    ("last batches finish, staging done", FEW_INFLIGHT, None, 0, ("draining", None)),
    ("idle while others finish", IDLE_ENGINE, None, 0, ("draining", None)),
    ("producer slower than the fleet", FEW_INFLIGHT, 120.0, 0, ("underused", "starved")),
    ("idle while the producer stages", IDLE_ENGINE, 120.0, 0, ("underused", "starved")),
    ("staging began within the window: run start", IDLE_ENGINE, 30.0, 0, ("draining", None)),
    ("another worker sits on unsent prompts", IDLE_ENGINE, None, 200, ("underused", "unbalanced")),
    ("unbalanced beats starved", FEW_INFLIGHT, 120.0, 50, ("underused", "unbalanced")),
]


@pytest.mark.parametrize(
    ("engine", "staging_s", "backlog", "expected"),
    [case[1:] for case in TAIL_CASES],
    ids=[case[0] for case in TAIL_CASES],
)
def test_end_of_run_table(
    engine: dict[str, Any],
    staging_s: float | None,
    backlog: int,
    expected: tuple[str, str | None],
) -> None:
    mine = recorded(79, jitter_w=5.0, **engine)
    other = recorded(690, uuid="GPU-other", inflight=64, waiting=backlog)
    staging = None if staging_s is None else {"run-a": NOW - staging_s}
    state = fleet(0, workers=("w1", "w2"), staging=staging, pending=3)
    samples = {"w1": mine, "w2": other}
    rows = [r for r in verdicts(samples, state, NOW) if r["worker"] == "w1"]
    assert [(r["verdict"], r["cause"]) for r in rows] == [expected]
    findings = diagnose(samples, state, NOW)
    assert [(f.worker, f.cause) for f in findings] == (
        [] if expected[1] is None else [("w1", expected[1])]
    )
    if expected[1] == "unbalanced":
        assert findings[0].numbers["backlog_elsewhere"] == backlog
        assert str(backlog) in findings[0].suggestion
    if expected[1] == "starved":
        assert "run-a" in findings[0].suggestion


def test_a_worker_s_own_backlog_is_not_a_balance_problem() -> None:
    """Its limiter is full: it is not idle for want of work."""
    mine = recorded(300, inflight=64, inflight_cap=64, waiting=500, running=None, queued=None)
    (finding,) = diagnose({"w1": mine}, fleet(0), NOW)
    assert finding.cause == "client_limited"


def test_a_window_that_began_idle_is_starting_not_underused() -> None:
    """The first beat after work arrives sees a window that still holds the idle time before
    it: its low mean is no evidence against MTP or feeding. A full busy window is."""
    busy = recorded(300, **FEW_INFLIGHT)
    began = {**busy, "idle_in_window": True}
    assert diagnose({"w1": busy}, fleet(), NOW)[0].cause == "client_limited"
    assert diagnose({"w1": began}, fleet(), NOW) == []
    assert [r["verdict"] for r in verdicts({"w1": began}, fleet(), NOW)] == ["starting"]
    capped = {**recorded(300, running=48, queued=16), "idle_in_window": True}
    assert [r["verdict"] for r in verdicts({"w1": capped}, fleet(), NOW)] == ["starting"]
    # ... but a GPU idle while a run stages is starved whatever the window holds
    idle = {**recorded(79, **IDLE_ENGINE), "idle_in_window": True}
    state = fleet(0, staging={"run-a": NOW - 120}, pending=0)
    assert [f.cause for f in diagnose({"w1": idle}, state, NOW)] == ["starved"]


def test_the_window_says_when_the_worker_had_nothing_to_send() -> None:
    window = TelemetryWindow(WINDOW_S)
    window.add_engine(EngineState(up=True), NOW - 50)
    window.add_engine(EngineState(up=True, inflight=64, inflight_cap=64), NOW - 1)
    assert window.summary(NOW)["idle_in_window"] is True
    assert window.summary(NOW + 55)["idle_in_window"] is False
