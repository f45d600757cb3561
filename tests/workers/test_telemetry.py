"""Telemetry: window maths, GPU selection, the samplers' failure modes, SGLang readers."""

from __future__ import annotations

import json
import socket
import sys
import types
from collections.abc import Iterator
from typing import Any

import pytest

from genfleet.workers.observe.engine_state import (
    EngineState,
    engine_state_from_metrics,
    engine_state_from_server_info,
)
from genfleet.workers.observe.telemetry import (
    EmulatorSampler,
    GpuSample,
    NvmlDevice,
    NvmlSampler,
    TelemetryWindow,
    resolve_gpus,
)
from tests.fakes.http_engine import ScriptedEngine

NOW = 1_760_000_000.0


def gpu(ts: float, power_w: float, energy_j: float | None, uuid: str = "GPU-a") -> GpuSample:
    return GpuSample(
        ts=ts,
        gpu_uuid=uuid,
        gpu_name="NVIDIA H200",
        power_w=power_w,
        power_limit_w=700.0,
        default_power_limit_w=700.0,
        utilization_pct=98.0,
        energy_j=energy_j,
    )


def test_mean_power_comes_from_the_energy_counter() -> None:
    window = TelemetryWindow(60.0)
    # 1 Hz readings alternate 100 W / 900 W but the counter integrated 527 W throughout.
    window.add(gpu(NOW - 60 + k, 100.0 if k % 2 else 900.0, 5e6 + 527.0 * k) for k in range(61))
    (g,) = window.summary(NOW)["gpus"]
    assert g["power_source"] == "energy"
    assert g["power_w"] == pytest.approx(527.0)
    assert g["energy_delta_j"] == pytest.approx(527.0 * 60)
    assert g["share_of_limit"] == pytest.approx(527.0 / 700.0)
    assert g["last_power_w"] == 900.0
    assert g["samples"] == 61


@pytest.mark.parametrize(
    "energies",
    [[None] * 4, [5e6, 5e6 + 400, 3.0, 403.0]],  # no counter; a counter reset (driver reload)
    ids=["no-counter", "counter-reset"],
)
def test_mean_power_falls_back_to_readings(energies: list[float | None]) -> None:
    window = TelemetryWindow(60.0)
    window.add(
        gpu(NOW - 3 + k, w, e)
        for k, (w, e) in enumerate(zip([380, 420, 390, 410], energies, strict=True))
    )
    (g,) = window.summary(NOW)["gpus"]
    assert g["power_source"] == "readings"
    assert g["power_w"] == pytest.approx(400.0)
    assert g["energy_delta_j"] == pytest.approx(400.0 * 3)


def test_single_sample_reads_its_power() -> None:
    window = TelemetryWindow(60.0)
    window.add([gpu(NOW, 79.0, 1e6)])
    (g,) = window.summary(NOW)["gpus"]
    assert (g["power_w"], g["power_source"], g["energy_delta_j"]) == (79.0, "readings", None)


def test_tokens_per_s_and_j_per_token() -> None:
    window = TelemetryWindow(60.0)
    window.add(gpu(NOW - 60 + k, 690.0, 1e6 + 690.0 * k) for k in range(61))
    for k in range(60):
        window.add_tokens(1200, NOW - 59.5 + k)
    summary = window.summary(NOW)
    assert summary["tokens"] == 72_000
    assert summary["tokens_total"] == 72_000
    assert summary["tokens_per_s"] == pytest.approx(1200.0)
    assert summary["j_per_token"] == pytest.approx(690.0 / 1200.0)  # 41 400 J / 72 000 tok


def test_young_window_divides_by_its_own_age() -> None:
    window = TelemetryWindow(60.0)
    window.add([gpu(NOW - 10, 300.0, 0.0)])
    window.add_tokens(1000, NOW - 5)
    summary = window.summary(NOW)
    assert summary["span_s"] == 10.0
    assert summary["tokens_per_s"] == pytest.approx(100.0)


def test_no_tokens_means_no_j_per_token() -> None:
    window = TelemetryWindow(60.0)
    window.add([gpu(NOW - 1, 79.0, 0.0), gpu(NOW, 79.0, 79.0)])
    summary = window.summary(NOW)
    assert (summary["tokens_per_s"], summary["j_per_token"]) == (0.0, None)


def test_summary_covers_the_window_before_now_only() -> None:
    window = TelemetryWindow(10.0)
    window.add(gpu(NOW - 30 + k, 100.0 + k, None) for k in range(31))
    window.add_tokens(5, NOW - 20)
    window.add_tokens(7, NOW - 2)
    summary = window.summary(NOW - 5)  # (NOW-15, NOW-5]
    (g,) = summary["gpus"]
    assert g["samples"] == 11
    assert g["last_ts"] == NOW - 5
    assert summary["tokens"] == 0
    assert window.summary(NOW)["tokens"] == 7
    assert window.summary(NOW + 100)["gpus"] == []  # nothing recent: no GPU row


def test_ring_drops_entries_older_than_two_windows() -> None:
    window = TelemetryWindow(10.0)
    window.add(gpu(NOW - 100 + k, 100.0, None) for k in range(101))
    assert len(window._gpus["GPU-a"]) == 21  # [NOW-20, NOW]


def test_engine_state_in_summary() -> None:
    window = TelemetryWindow(60.0)
    window.add_engine(EngineState(up=False, restarting=True), NOW - 40)
    up = EngineState(up=True, inflight=3, inflight_cap=64, speculative_algorithm="EAGLE")
    window.add_engine(up, NOW - 2)
    summary = window.summary(NOW)
    assert summary["engine"] == up.to_json()
    assert summary["engine_age_s"] == 2.0
    assert summary["engine_down_in_window"] is True
    assert window.summary(NOW + 30)["engine_down_in_window"] is False
    assert json.loads(json.dumps(summary)) == summary
    assert EngineState.from_json(summary["engine"]) == up


def test_sampler_status_travels_in_summary() -> None:
    window = TelemetryWindow(60.0)
    window.set_sampler_status(False, "NVML unavailable: no driver")
    summary = window.summary(NOW)
    assert (summary["telemetry_available"], summary["telemetry_reason"]) == (
        False,
        "NVML unavailable: no driver",
    )
    assert summary["power_w"] is None


def test_gpu_sample_json_round_trip() -> None:
    sample = gpu(NOW, 527.0, 1.5e6)
    assert GpuSample.from_json(json.loads(json.dumps(sample.to_json()))) == sample


DEVICES = [  # NVML index order differs from PCI bus order here
    NvmlDevice(0, "GPU-cccc", "00000000:C1:00.0"),
    NvmlDevice(1, "GPU-aaaa", "00000000:18:00.0"),
    NvmlDevice(2, "GPU-bbbb", "00000000:3A:00.0"),
]


@pytest.mark.parametrize(
    ("selectors", "visible", "expected"),
    [
        (None, None, ["GPU-aaaa", "GPU-bbbb", "GPU-cccc"]),
        (["0"], None, ["GPU-aaaa"]),
        (["2", "0"], None, ["GPU-cccc", "GPU-aaaa"]),
        (["GPU-bbbb"], None, ["GPU-bbbb"]),
        (["GPU-bb"], None, ["GPU-bbbb"]),
        (["1"], "2,1", ["GPU-bbbb"]),
        (None, "GPU-cccc,0", ["GPU-cccc", "GPU-aaaa"]),
        (None, "1,7,0", ["GPU-bbbb"]),  # CUDA stops at the first bad entry
        (None, "", []),
    ],
)
def test_resolve_gpus(
    selectors: list[str] | None, visible: str | None, expected: list[str]
) -> None:
    assert resolve_gpus(selectors, visible, DEVICES) == expected


@pytest.mark.parametrize(("selectors", "visible"), [(["3"], None), (["1"], "2"), (["GPU-"], None)])
def test_resolve_gpus_refuses_unknown(selectors: list[str], visible: str | None) -> None:
    with pytest.raises(ValueError):
        resolve_gpus(selectors, visible, DEVICES)


def test_nvml_sampler_on_a_machine_without_nvml() -> None:
    import pynvml

    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError:
        pass
    else:
        pynvml.nvmlShutdown()
        pytest.skip("this machine has NVML")
    sampler = NvmlSampler(["0"])
    assert sampler.available is False
    assert sampler.reason and "NVML" in sampler.reason
    assert sampler.sample() == []
    sampler.close()


def test_nvml_sampler_without_the_package(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "pynvml", None)
    sampler = NvmlSampler()
    assert sampler.available is False
    assert sampler.reason and "nvidia-ml-py" in sampler.reason
    assert sampler.sample() == []


class _NVMLError(Exception):
    pass


def _fake_pynvml(lost: set[str]) -> types.ModuleType:
    """Just enough of pynvml: two GPUs, no energy counter, one GPU may be lost."""
    uuids = ["GPU-cccc", "GPU-aaaa"]
    buses = ["00000000:C1:00.0", "00000000:18:00.0"]

    def power(h: str) -> int:
        if h in lost:
            raise _NVMLError("GPU is lost")
        return 412_345

    def not_supported(*_: Any) -> Any:
        raise _NVMLError("Not Supported")

    m = types.ModuleType("pynvml")
    m.__dict__.update(
        NVMLError=_NVMLError,
        NVML_CLOCK_SM=1,
        NVML_TEMPERATURE_GPU=0,
        nvmlInit=lambda: None,
        nvmlShutdown=lambda: None,
        nvmlDeviceGetCount=lambda: 2,
        nvmlDeviceGetHandleByIndex=lambda i: uuids[i],
        nvmlDeviceGetHandleByUUID=lambda u: u,
        nvmlDeviceGetUUID=lambda h: h.encode(),
        nvmlDeviceGetPciInfo=lambda h: types.SimpleNamespace(busId=buses[uuids.index(h)].encode()),
        nvmlDeviceGetName=lambda h: "NVIDIA H200",
        nvmlDeviceGetPowerUsage=power,
        nvmlDeviceGetEnforcedPowerLimit=lambda h: 600_000,
        nvmlDeviceGetPowerManagementDefaultLimit=lambda h: 700_000,
        nvmlDeviceGetUtilizationRates=lambda h: types.SimpleNamespace(gpu=98, memory=40),
        nvmlDeviceGetMemoryInfo=lambda h: types.SimpleNamespace(used=2**30, total=141 * 2**30),
        nvmlDeviceGetClockInfo=lambda h, t: 1980,
        nvmlDeviceGetTemperature=lambda h, s: 51,
        nvmlDeviceGetTotalEnergyConsumption=not_supported,
    )
    return m


def test_nvml_sampler_maps_readings_and_errors(monkeypatch: pytest.MonkeyPatch) -> None:
    lost: set[str] = set()
    monkeypatch.setitem(sys.modules, "pynvml", _fake_pynvml(lost))
    sampler = NvmlSampler(["0", "GPU-cccc"], visible_devices=None, clock=lambda: NOW)
    assert sampler.available and sampler.gpu_uuids == ["GPU-aaaa", "GPU-cccc"]
    first, _ = sampler.sample()
    assert first == GpuSample(
        ts=NOW,
        gpu_uuid="GPU-aaaa",
        gpu_name="NVIDIA H200",
        power_w=412.345,
        power_limit_w=600.0,
        default_power_limit_w=700.0,
        utilization_pct=98.0,
        memory_used_mib=1024.0,
        memory_total_mib=141 * 1024.0,
        sm_clock_mhz=1980.0,
        temperature_c=51.0,
        energy_j=None,
    )
    lost.add("GPU-cccc")
    (only,) = sampler.sample()
    assert only.gpu_uuid == "GPU-aaaa"
    assert sampler.reason == "GPU-cccc: GPU is lost"
    sampler.close()
    assert sampler.sample() == []


def test_nvml_sampler_reports_a_bad_selector(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "pynvml", _fake_pynvml(set()))
    sampler = NvmlSampler(["5"], visible_devices=None)
    assert sampler.available is False
    assert sampler.reason and "out of range" in sampler.reason


EMULATED = {
    "gpus": [
        {
            "gpu_uuid": "GPU-emulated-0",
            "gpu_name": "genfleet emulator",
            "power_w": 412.0,
            "power_limit_w": 700.0,
            "default_power_limit_w": 700.0,
            "energy_j": 12_345.6,
            "utilization_pct": 61.0,
            "memory_used_mib": 70_000.0,
            "memory_total_mib": 143_771.0,
            "sm_clock_mhz": 1980.0,
            "temperature_c": 48.0,
            "running": 12,
            "queued": 0,
        }
    ]
}


POWER = "/genfleet/power"


@pytest.fixture
def emulator() -> Iterator[ScriptedEngine]:
    """A real HTTP server on a free loopback port serving the emulator's power shape."""
    engine = ScriptedEngine()
    engine.routes[POWER] = (200, json.dumps(EMULATED).encode(), {})
    yield engine.start()
    engine.stop()


def test_emulator_sampler_reads_the_simulated_gpu(emulator: ScriptedEngine) -> None:
    sampler = EmulatorSampler(emulator.url, clock=lambda: NOW)
    try:
        (sample,) = sampler.sample()
        assert sample.ts == NOW
        assert (sample.gpu_uuid, sample.power_w, sample.power_limit_w) == (
            "GPU-emulated-0",
            412.0,
            700.0,
        )
        assert sample.energy_j == 12_345.6
        assert sampler.available and sampler.reason is None

        emulator.routes[POWER] = (500, b"boom", {})
        assert sampler.sample() == []
        assert sampler.available and sampler.reason and "500" in sampler.reason

        emulator.routes[POWER] = (200, b'{"gpus": [{"power_w": 1}]}', {})
        assert sampler.sample() == []
        assert sampler.reason and "TypeError" in sampler.reason
    finally:
        sampler.close()


def test_emulator_sampler_when_nothing_listens() -> None:
    with socket.socket() as s:  # a loopback port that was free a moment ago
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    sampler = EmulatorSampler(f"http://127.0.0.1:{port}", timeout_s=0.5)
    try:
        assert sampler.sample() == []
        assert sampler.available is True
        assert sampler.reason and "ConnectError" in sampler.reason
    finally:
        sampler.close()


METRICS_TEXT = """\
# HELP sglang:num_running_reqs The number of running requests.
# TYPE sglang:num_running_reqs gauge
sglang:num_running_reqs<dp0> 31.0
sglang:num_running_reqs<dp1> 17.0
sglang:num_running_reqs<dp0-tp1> 31.0
# HELP sglang:num_queue_reqs The number of requests in the waiting queue.
# TYPE sglang:num_queue_reqs gauge
sglang:num_queue_reqs<dp0> 5.0
sglang:num_queue_reqs<dp1> 0.0
# HELP sglang:gen_throughput The generation throughput (token/s).
# TYPE sglang:gen_throughput gauge
sglang:gen_throughput<dp0> 1510.5
sglang:gen_throughput<dp1> 1489.5
# HELP sglang:spec_accept_length The average acceptance length of speculative decoding.
# TYPE sglang:spec_accept_length gauge
sglang:spec_accept_length<dp0> 2.5
sglang:spec_accept_length<dp1> 2.7
# HELP sglang:prompt_tokens_total Number of prefill tokens processed.
# TYPE sglang:prompt_tokens_total counter
sglang:prompt_tokens_total{engine_type="unified",model_name="qwen"} 123456.0
# HELP sglang:e2e_request_latency_seconds Histogram of End-to-end request latency in seconds
# TYPE sglang:e2e_request_latency_seconds histogram
sglang:e2e_request_latency_seconds_bucket{engine_type="unified",le="0.1",model_name="qwen"} 0.0
sglang:e2e_request_latency_seconds_bucket{engine_type="unified",le="+Inf",model_name="qwen"} 42.0
sglang:e2e_request_latency_seconds_count{engine_type="unified",model_name="qwen"} 42.0
sglang:e2e_request_latency_seconds_sum{engine_type="unified",model_name="qwen"} 901.2
"""
_SCHED = 'engine_type="unified",model_name="qwen",moe_ep_rank="0",pp_rank="0"'
METRICS_TEXT = (  # scheduler gauges as SGLang labels them with --dp-size 2 --tp-size 2
    METRICS_TEXT.replace("<dp0>", f'{{dp_rank="0",{_SCHED},tp_rank="0"}}')
    .replace("<dp1>", f'{{dp_rank="1",{_SCHED},tp_rank="0"}}')
    .replace("<dp0-tp1>", f'{{dp_rank="0",{_SCHED},tp_rank="1"}}')
)


def test_engine_state_from_metrics() -> None:
    assert engine_state_from_metrics(METRICS_TEXT) == {
        "running": 48,
        "queued": 5,
        "engine_tokens_per_s": pytest.approx(3000.0),
        "accept_length": pytest.approx(2.6),
    }


def test_engine_state_from_metrics_without_spec_or_garbage() -> None:
    no_spec = METRICS_TEXT.replace("} 2.5", "} 0.0").replace("} 2.7", "} 0.0")
    assert "accept_length" not in engine_state_from_metrics(no_spec)
    assert engine_state_from_metrics("") == {}
    assert engine_state_from_metrics("sglang:num_running_reqs{oops 3\n") == {}


def test_engine_state_from_server_info() -> None:
    info = {
        "model_path": "/models/Qwen3.6-35B-A3B",
        "speculative_algorithm": "EAGLE",
        "speculative_num_steps": 3,
        "speculative_eagle_topk": 1,
        "speculative_num_draft_tokens": 4,
        "max_running_requests": 48,
        "dp_size": 1,
        "status": "ready",
        "internal_states": [
            {
                "last_gen_throughput": 1480.2,
                "effective_max_running_requests_per_dp": 48,
                "avg_spec_accept_length": 2.61,
            }
        ],
        "version": "0.5.11",
    }
    assert engine_state_from_server_info(info) == {
        "speculative_algorithm": "EAGLE",
        "max_running_requests": 48,
        "configured_max_running_requests": 48,
        "cap_limit": "configured",
        "accept_length": 2.61,
    }
    off = {
        **info,
        "speculative_algorithm": None,
        "max_running_requests": None,
        "dp_size": 2,
        "internal_states": [{"effective_max_running_requests_per_dp": 256}],
    }
    assert engine_state_from_server_info(off) == {
        "speculative_algorithm": None,
        "max_running_requests": 512,
        "cap_limit": "kv",  # none configured: SGLang sized it from its KV cache
    }


def test_readers_build_an_engine_state() -> None:
    info = engine_state_from_server_info(
        {
            "speculative_algorithm": "EAGLE",
            "max_running_requests": 48,
            "internal_states": [{"avg_spec_accept_length": 2.1}],
        }
    )
    state = EngineState(
        up=True, inflight=64, inflight_cap=64, **{**info, **engine_state_from_metrics(METRICS_TEXT)}
    )
    assert (state.running, state.queued) == (48, 5)
    assert state.accept_length == pytest.approx(2.6)  # the metrics' interval mean wins
