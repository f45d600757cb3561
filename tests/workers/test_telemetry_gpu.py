"""On a real NVIDIA GPU: NVML readings are there and plausible. Deselected by default
(`-m gpu` runs it); on an H200 expect a 700 W limit, ~80 W idle, a growing energy counter."""

from __future__ import annotations

import threading
import time

import pytest

from genfleet.workers.observe.diagnosis import diagnose, verdicts
from genfleet.workers.observe.engine_state import EngineState
from genfleet.workers.observe.telemetry import NvmlSampler, TelemetryWindow

pytestmark = pytest.mark.gpu


def test_nvml_reads_power_limit_and_energy() -> None:
    sampler = NvmlSampler()
    assert sampler.available, sampler.reason
    window = TelemetryWindow(60.0)
    try:
        first = sampler.sample()
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:  # the energy counter ticks at least every ~100 ms
            time.sleep(0.5)
            later = sampler.sample()
            window.add(later)
            if all(
                b.energy_j is None or a.energy_j is None or b.energy_j > a.energy_j
                for a, b in zip(first, later, strict=True)
            ):
                break
        window.add(first)
    finally:
        sampler.close()
    assert first
    for s in first:
        print(s.to_json())
        assert s.gpu_uuid.startswith("GPU-")
        assert 50.0 <= s.power_limit_w <= 1500.0
        assert s.default_power_limit_w is None or 50.0 <= s.default_power_limit_w <= 1500.0
        assert 5.0 <= s.power_w <= s.power_limit_w * 1.2
        assert s.memory_total_mib is None or s.memory_total_mib > 1000
        assert s.energy_j is None or s.energy_j > 0
    for a, b in zip(first, later, strict=True):
        if a.energy_j is not None and b.energy_j is not None:
            assert b.energy_j > a.energy_j
    summary = window.summary(time.time())
    assert all(5.0 <= g["power_w"] <= 1500.0 for g in summary["gpus"])


def test_idle_gpu_with_work_waiting_is_flagged() -> None:
    sampler = NvmlSampler()
    assert sampler.available, sampler.reason
    window = TelemetryWindow(60.0)
    try:
        for _ in range(3):
            window.add(sampler.sample())
            time.sleep(0.5)
    finally:
        sampler.close()
    state = EngineState(up=True, inflight=1, inflight_cap=64, speculative_algorithm="EAGLE")
    window.add_engine(state, time.time())
    now = time.time()
    findings = diagnose({"w": window.summary(now)}, {"queue_depth": 10}, now)
    print([f.to_json() for f in findings])
    assert {f.cause for f in findings} == {"client_limited"}


def test_saturating_load_is_not_flagged() -> None:
    torch = pytest.importorskip("torch")
    sampler = NvmlSampler(["0"])  # the GPU torch calls cuda:0 (one GPU, or PCI_BUS_ID order)
    assert sampler.available, sampler.reason
    stop = threading.Event()

    def burn() -> None:  # compute-bound bf16 matmuls: ~690 W on an H200
        a = torch.randn(8192, 8192, device="cuda:0", dtype=torch.bfloat16)
        while not stop.is_set():
            for _ in range(20):
                a @ a
            torch.cuda.synchronize()

    thread = threading.Thread(target=burn, daemon=True)
    thread.start()
    window = TelemetryWindow(5.0)
    try:
        deadline = time.monotonic() + 8.0
        while time.monotonic() < deadline:
            window.add(sampler.sample())
            time.sleep(0.25)
    finally:
        stop.set()
        thread.join(timeout=30)
        sampler.close()
    state = EngineState(up=True, inflight=64, inflight_cap=64, speculative_algorithm="EAGLE")
    window.add_engine(state, time.time())
    now = time.time()
    summary = window.summary(now)
    print(summary["gpus"])
    rows = verdicts({"w": summary}, {"queue_depth": 10}, now)
    print(rows)
    assert rows and all(r["verdict"] == "ok" for r in rows)
