"""A simulated GPU's power draw and energy counter, for testing the power-watch end to end.

Power follows batch occupancy (running / max_running_requests), concave because the first
requests already stream all weights through memory:

    power_w = idle + (0.95 × limit − idle) × min(1, occupancy^0.7 × intensity)

with intensity 1.15 under speculative decoding (verify work per step) and 1.0 without. One
request of 256 draws close to idle; a full batch draws about 95 % of the limit. Utilisation
reads near 100 % as soon as anything runs, which is how NVML's figure hides underuse. Energy
integrates power over real (not time-scaled) seconds, like NVML's total energy counter.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

PEAK_FRACTION = 0.95
OCCUPANCY_EXPONENT = 0.7
SPEC_INTENSITY = 1.15
GPU_NAME = "Emulated H200"
MEMORY_TOTAL_MIB = 143_771
SM_CLOCK_MAX_MHZ = 1980
WEIGHTS_OVERHEAD_MIB = 512


@dataclass(frozen=True, slots=True)
class PowerModel:
    """Maps batch occupancy to watts for one GPU."""

    idle_power_w: float
    power_limit_w: float
    spec: bool

    def load(self, running: int, max_running: int) -> float:
        """0 when idle, 1 when the GPU is as busy as this model lets it get."""
        if running <= 0 or max_running <= 0:
            return 0.0
        occupancy = min(1.0, running / max_running)
        intensity = SPEC_INTENSITY if self.spec else 1.0
        return min(1.0, float(occupancy**OCCUPANCY_EXPONENT) * intensity)

    def power_w(self, running: int, max_running: int) -> float:
        peak = max(self.idle_power_w, PEAK_FRACTION * self.power_limit_w)
        return self.idle_power_w + (peak - self.idle_power_w) * self.load(running, max_running)


class EnergyMeter:
    """Integrates a piecewise-constant power over time; `now` is always passed in."""

    def __init__(self, now: float, power_w: float):
        self._t = now
        self._power_w = power_w
        self._energy_j = 0.0

    def set_power(self, now: float, power_w: float) -> None:
        """Close the interval at the old power and continue at `power_w` from `now`."""
        self._energy_j += self._power_w * max(0.0, now - self._t)
        self._t = now
        self._power_w = power_w

    def energy_j(self, now: float) -> float:
        return self._energy_j + self._power_w * max(0.0, now - self._t)


def gpu_readings(
    *,
    port: int,
    tp_size: int,
    model: PowerModel,
    meter: EnergyMeter,
    running: int,
    queued: int,
    max_running: int,
    mem_fraction_static: float,
    now: float,
    node: NodeKnobs | None = None,
) -> dict[str, Any]:
    """The body of GET /genfleet/power: `{"gpus": [...]}`, one entry per tensor-parallel rank."""
    load = model.load(running, max_running)
    power = model.power_w(running, max_running)
    energy = meter.energy_j(now)
    gpu = {
        "gpu_name": GPU_NAME,
        "power_w": round(power, 3),
        "power_limit_w": model.power_limit_w,
        "default_power_limit_w": model.power_limit_w,
        "energy_j": round(energy, 3),
        "utilization_pct": 0 if running == 0 else round(95 + 5 * load),
        "memory_used_mib": round(MEMORY_TOTAL_MIB * mem_fraction_static) + WEIGHTS_OVERHEAD_MIB,
        "memory_total_mib": MEMORY_TOTAL_MIB,
        "sm_clock_mhz": round(SM_CLOCK_MAX_MHZ - 180 * load),
        "temperature_c": round(30 + 45 * power / model.power_limit_w, 1),
        "running": running,
        "queued": queued,
    }
    gpus = [{"gpu_uuid": f"EMU-{port}-{rank}", **gpu} for rank in range(tp_size)]
    return {"gpus": gpus, "node_gpus": node_gpus(gpus, model, node or NodeKnobs())}


@dataclass(frozen=True, slots=True)
class NodeKnobs:
    """The rest of the emulated node: `unclaimed` GPUs that no worker claims (idle, shared by
    every emulator on the machine: the same UUIDs), and a process of `foreign_mib` MiB that is
    not the engine on the engine's own GPUs (pid 1, never in the engine's process group)."""

    engine_pid: int = 0
    unclaimed: int = 0
    foreign_mib: int = 0


def node_gpus(
    gpus: list[dict[str, Any]], model: PowerModel, node: NodeKnobs
) -> list[dict[str, Any]]:
    """Every GPU of the emulated node in NVML's node shape (`NvmlSampler.node_gpus`)."""
    engine = [{"pid": node.engine_pid, "used_memory_mib": g["memory_used_mib"]} for g in gpus]
    foreign = [{"pid": 1, "used_memory_mib": node.foreign_mib}] if node.foreign_mib else []
    own = [
        {**_node_fields(g), "index": i, "processes": [engine[i], *foreign]}
        for i, g in enumerate(gpus)
    ]
    spare = [
        {
            "index": len(gpus) + i,
            "gpu_uuid": f"EMU-UNCLAIMED-{i}",
            "gpu_name": GPU_NAME,
            "power_w": model.idle_power_w,
            "power_limit_w": model.power_limit_w,
            "memory_used_mib": 0,
            "processes": [],
        }
        for i in range(node.unclaimed)
    ]
    return own + spare


def _node_fields(gpu: dict[str, Any]) -> dict[str, Any]:
    keep = ("gpu_uuid", "gpu_name", "power_w", "power_limit_w", "memory_used_mib")
    return {k: gpu[k] for k in keep}
