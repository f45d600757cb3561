"""GPU telemetry of one worker: samplers and a time window of GPU and engine readings.

A worker samples its own GPUs about once a second (`sample_interval_s`) through a `Sampler`:
`NvmlSampler` on real GPUs, `EmulatorSampler` when the engine emulator simulates the draw.
Samples, engine states and generated tokens go into a `TelemetryWindow`, whose `summary(now)`
is what the power-watch inspect command returns and what `observe.diagnosis.diagnose` reads.
Mean power comes from the energy counter delta, not from averaging instantaneous readings:
the counter integrates every millisecond, a 1 Hz reading does not.
"""

from __future__ import annotations

import os
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Mapping
from dataclasses import asdict, dataclass, fields
from typing import Any, Protocol

import httpx

from genfleet.workers.observe.engine_state import EngineState

_INSTALL_HINT = "install nvidia-ml-py (pip install 'genfleet[worker]')"


@dataclass(frozen=True)
class GpuSample:
    """One reading of one GPU. Watts, MiB, MHz, °C and joules as the names say.

    `power_limit_w` is the enforced limit (what the GPU may draw now), the one underuse is
    measured against; `energy_j` is the driver's cumulative counter (None where unsupported).
    """

    ts: float
    gpu_uuid: str
    gpu_name: str
    power_w: float
    power_limit_w: float
    default_power_limit_w: float | None = None
    utilization_pct: float | None = None
    memory_used_mib: float | None = None
    memory_total_mib: float | None = None
    sm_clock_mhz: float | None = None
    temperature_c: float | None = None
    energy_j: float | None = None

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> GpuSample:
        """Rebuild a sample from `to_json()` output or the emulator's shape (extra keys ignored)."""
        names = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in data.items() if k in names})


class Sampler(Protocol):
    """Where GPU readings come from. `sample()` never raises: [] plus `reason` when it cannot."""

    available: bool
    reason: str | None

    def sample(self) -> list[GpuSample]: ...


@dataclass(frozen=True)
class NvmlDevice:
    """What selection needs to know about one NVML device."""

    index: int
    uuid: str
    pci_bus_id: str


def resolve_gpus(
    selectors: list[str] | None, visible_devices: str | None, devices: list[NvmlDevice]
) -> list[str]:
    """The UUIDs a worker owns, from `--gpus` selectors and CUDA_VISIBLE_DEVICES.

    NVML's index order is not CUDA's, so indices are resolved the way CUDA would with
    `CUDA_DEVICE_ORDER=PCI_BUS_ID`: by PCI bus id. A selector is a UUID (or a unique prefix of
    one, as CUDA accepts) or an index; an index counts within CUDA_VISIBLE_DEVICES when that is
    set, else among all GPUs. No selectors: every visible GPU. Raises ValueError naming the
    selector that matches nothing.

        resolve_gpus(["1"], "2,3", devs)          # the GPU with PCI order 3
        resolve_gpus(["GPU-8f3a"], None, devs)    # by UUID prefix
    """
    by_bus = sorted(devices, key=lambda d: d.pci_bus_id)

    def one(selector: str, pool: list[NvmlDevice]) -> str:
        s = selector.strip()
        if s.isdigit():
            if int(s) >= len(pool):
                raise ValueError(f"GPU index {s} out of range: {len(pool)} visible")
            return pool[int(s)].uuid
        matches = [d.uuid for d in devices if d.uuid.startswith(s)] if s else []
        if len(matches) != 1:
            raise ValueError(f"GPU {s!r} matches {len(matches)} devices")
        return matches[0]

    pool = by_bus
    if visible_devices is not None:
        visible: list[NvmlDevice] = []
        for entry in visible_devices.split(","):
            try:  # CUDA stops at the first entry it cannot resolve
                uuid = one(entry, by_bus)
            except ValueError:
                break
            visible.append(next(d for d in devices if d.uuid == uuid))
        pool = visible
    if not selectors:
        return [d.uuid for d in pool]
    return [one(s, pool) for s in selectors]


class NvmlSampler:
    """Reads the worker's GPUs through NVML (`import pynvml`, from the nvidia-ml-py package).

    On a machine without NVML (no package, no driver, no device) it is `available=False` with
    the reason and samples nothing; construction and `sample()` never raise. NVML errors are
    mapped here: a field the GPU does not support reads None; a GPU that cannot report power
    is left out of the sample and named in `reason`.
    """

    def __init__(
        self,
        gpus: list[str] | None = None,
        *,
        visible_devices: str | None = None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.available = False
        self.reason: str | None = None
        self._clock = clock
        self._nvml: Any = None
        self._handles: list[tuple[str, str, Any]] = []  # uuid, name, handle
        if visible_devices is None:
            visible_devices = os.environ.get("CUDA_VISIBLE_DEVICES")
        try:
            import pynvml
        except ImportError:
            self.reason = f"NVML unavailable: {_INSTALL_HINT}"
            return
        try:
            pynvml.nvmlInit()
        except (pynvml.NVMLError, OSError) as exc:  # LibraryNotFound, DriverNotLoaded, ...
            self.reason = f"NVML unavailable: {exc}"
            return
        self._nvml = pynvml
        try:
            self._open(gpus, visible_devices)
        except (pynvml.NVMLError, ValueError) as exc:
            self.reason = f"NVML GPU selection failed: {exc}"
            self.close()
            return
        if not self._handles:
            self.reason = "NVML found no GPU for this worker"
            self.close()
            return
        self.available = True

    def _open(self, gpus: list[str] | None, visible_devices: str | None) -> None:
        nvml = self._nvml
        devices = []
        for i in range(nvml.nvmlDeviceGetCount()):
            h = nvml.nvmlDeviceGetHandleByIndex(i)
            bus = nvml.nvmlDeviceGetPciInfo(h).busId
            devices.append(NvmlDevice(i, _text(nvml.nvmlDeviceGetUUID(h)), _text(bus)))
        for uuid in resolve_gpus(gpus, visible_devices, devices):
            h = nvml.nvmlDeviceGetHandleByUUID(uuid)
            self._handles.append((uuid, _text(nvml.nvmlDeviceGetName(h)), h))

    @property
    def gpu_uuids(self) -> list[str]:
        return [uuid for uuid, _, _ in self._handles]

    def sample(self) -> list[GpuSample]:
        if not self.available:
            return []
        ts, out, failed = self._clock(), [], []
        for uuid, name, h in self._handles:
            try:
                out.append(self._read(ts, uuid, name, h))
            except self._nvml.NVMLError as exc:  # e.g. GPU lost: leave it out, say why
                failed.append(f"{uuid}: {exc}")
        self.reason = "; ".join(failed) or None
        return out

    def _read(self, ts: float, uuid: str, name: str, h: Any) -> GpuSample:
        nvml, opt = self._nvml, self._optional
        mem = opt(nvml.nvmlDeviceGetMemoryInfo, h)
        util = opt(nvml.nvmlDeviceGetUtilizationRates, h)
        return GpuSample(
            ts=ts,
            gpu_uuid=uuid,
            gpu_name=name,
            power_w=nvml.nvmlDeviceGetPowerUsage(h) / 1000.0,  # mW
            power_limit_w=nvml.nvmlDeviceGetEnforcedPowerLimit(h) / 1000.0,
            default_power_limit_w=_scaled(
                opt(nvml.nvmlDeviceGetPowerManagementDefaultLimit, h), 1e-3
            ),
            utilization_pct=_scaled(getattr(util, "gpu", None), 1.0),
            memory_used_mib=_scaled(getattr(mem, "used", None), 1 / 2**20),
            memory_total_mib=_scaled(getattr(mem, "total", None), 1 / 2**20),
            sm_clock_mhz=_scaled(opt(nvml.nvmlDeviceGetClockInfo, h, nvml.NVML_CLOCK_SM), 1.0),
            temperature_c=_scaled(
                opt(nvml.nvmlDeviceGetTemperature, h, nvml.NVML_TEMPERATURE_GPU), 1.0
            ),
            energy_j=_scaled(opt(nvml.nvmlDeviceGetTotalEnergyConsumption, h), 1e-3),  # mJ
        )

    def node_gpus(self) -> list[dict[str, Any]]:
        """Every GPU of this node, the worker's or not: index, UUID, name, power, limit,
        memory used and the compute processes on it (pid, MiB). [] without NVML."""
        nvml, opt, out = self._nvml, self._optional, []
        if nvml is None:
            return []
        for index in range(nvml.nvmlDeviceGetCount()):
            try:
                h = nvml.nvmlDeviceGetHandleByIndex(index)
                mem = opt(nvml.nvmlDeviceGetMemoryInfo, h)
                procs = opt(nvml.nvmlDeviceGetComputeRunningProcesses, h) or []
                out.append(
                    {
                        "index": index,
                        "gpu_uuid": _text(nvml.nvmlDeviceGetUUID(h)),
                        "gpu_name": _text(nvml.nvmlDeviceGetName(h)),
                        "power_w": _scaled(opt(nvml.nvmlDeviceGetPowerUsage, h), 1e-3),
                        "power_limit_w": _scaled(
                            opt(nvml.nvmlDeviceGetEnforcedPowerLimit, h), 1e-3
                        ),
                        "memory_used_mib": _scaled(getattr(mem, "used", None), 1 / 2**20),
                        "processes": [_process(p) for p in procs],
                    }
                )
            except nvml.NVMLError:  # a GPU that cannot answer is left out of this round
                continue
        return out

    def _optional(self, read: Callable[..., Any], *args: Any) -> Any:
        try:
            return read(*args)
        except self._nvml.NVMLError:  # NotSupported and friends: the field reads None
            return None

    def close(self) -> None:
        """Release NVML; the sampler is unavailable afterwards."""
        if self._nvml is not None:
            try:
                self._nvml.nvmlShutdown()
            except self._nvml.NVMLError:
                pass
        self._nvml, self._handles, self.available = None, [], False


class EmulatorSampler:
    """Reads the engine emulator's simulated GPU at `GET {base_url}/genfleet/power`.

    Used when the worker runs the emulator, so the power-watch sees the same shapes as on real
    GPUs. A failed read returns [] and sets `reason`; the sampler stays `available` because the
    emulator may be restarting.
    """

    def __init__(
        self,
        base_url: str,
        *,
        timeout_s: float = 2.0,
        clock: Callable[[], float] = time.time,
        transport: httpx.BaseTransport | None = None,
    ) -> None:
        self.available = True
        self.reason: str | None = None
        self._clock = clock
        self._client = httpx.Client(base_url=base_url, timeout=timeout_s, transport=transport)
        self._node: list[dict[str, Any]] = []

    def sample(self) -> list[GpuSample]:
        ts = self._clock()
        try:
            response = self._client.get("/genfleet/power")
            response.raise_for_status()
            body = response.json()
            samples = [GpuSample.from_json({**g, "ts": ts}) for g in body["gpus"]]
            self._node = list(body.get("node_gpus") or [])
        except (httpx.HTTPError, ValueError, KeyError, TypeError) as exc:
            self.reason = f"emulator power read failed: {type(exc).__name__}: {exc}"
            return []
        self.reason = None
        return samples

    def node_gpus(self) -> list[dict[str, Any]]:
        """The emulated node's GPUs as of the last sample (NvmlSampler.node_gpus' shape)."""
        return self._node

    def close(self) -> None:
        self._client.close()


class TelemetryWindow:
    """The last `window_s` seconds of one worker: GPU samples, engine states, tokens.

    Written by the sampler thread, the engine client and the batch tasks; read by the
    inspect command through `summary(now)`. Thread-safe. Entries older than twice the window
    (relative to the newest one) are dropped as they come in, so memory stays bounded.
    """

    def __init__(self, window_s: float, *, max_entries: int = 100_000) -> None:
        self.window_s = window_s
        self._lock = threading.Lock()
        self._gpus: dict[str, deque[GpuSample]] = {}
        self._engine: deque[tuple[float, EngineState]] = deque(maxlen=max_entries)
        self._tokens: deque[tuple[float, int]] = deque(maxlen=max_entries)
        self._max_entries = max_entries
        self._tokens_total = 0
        self._first_ts: float | None = None
        self.sampler_available = True
        self.sampler_reason: str | None = None

    def _seen(self, ts: float) -> None:
        self._first_ts = ts if self._first_ts is None else min(self._first_ts, ts)

    def _trim(self, ring: deque[Any], ts: float, at: Callable[[Any], float]) -> None:
        while ring and at(ring[0]) < ts - 2 * self.window_s:
            ring.popleft()

    def set_sampler_status(self, available: bool, reason: str | None) -> None:
        with self._lock:
            self.sampler_available, self.sampler_reason = available, reason

    def add(self, samples: Iterable[GpuSample]) -> None:
        with self._lock:
            for s in samples:
                ring = self._gpus.setdefault(s.gpu_uuid, deque(maxlen=self._max_entries))
                ring.append(s)
                self._trim(ring, s.ts, lambda x: x.ts)
                self._seen(s.ts)

    def add_engine(self, state: EngineState, ts: float) -> None:
        with self._lock:
            self._engine.append((ts, state))
            self._trim(self._engine, ts, lambda x: x[0])
            self._seen(ts)

    def add_tokens(self, n: int, ts: float) -> None:
        """Count `n` tokens generated up to `ts` (the Monitor adds what streamed since its
        last sample, answers in flight included)."""
        with self._lock:
            self._tokens.append((ts, n))
            self._tokens_total += n
            self._trim(self._tokens, ts, lambda x: x[0])
            self._seen(ts)

    def summary(self, now: float) -> dict[str, Any]:
        """Figures over (now - window_s, now], JSON-serialisable. Does not change the window.

        Keys: ts, window_s, span_s, first_ts, gpus (list of `_gpu_summary` dicts), engine
        (EngineState JSON or None), engine_age_s, engine_down_in_window, idle_in_window, tokens,
        tokens_total, tokens_per_s, power_w (sum of the GPUs' mean power), j_per_token,
        telemetry_available, telemetry_reason. `j_per_token` is the GPUs' energy over the
        window over its tokens (mean W / tok/s); with tensor parallelism, the whole group's.
        """
        start = now - self.window_s
        with self._lock:
            gpus = [
                _gpu_summary([s for s in ring if start <= s.ts <= now])
                for ring in self._gpus.values()
            ]
            engine = [(ts, st) for ts, st in self._engine if ts <= now]
            tokens = sum(n for ts, n in self._tokens if start < ts <= now)
            tokens_total, first = self._tokens_total, self._first_ts
            available, reason = self.sampler_available, self.sampler_reason
        rows = [g for g in gpus if g is not None]
        span = min(self.window_s, now - first) if first is not None else 0.0
        tokens_per_s = tokens / span if span > 0 else 0.0
        power_w = sum(g["power_w"] for g in rows) if rows else None
        last = engine[-1] if engine else None
        return {
            "ts": now,
            "window_s": self.window_s,
            "span_s": span,
            "first_ts": first,  # the first reading: the worker (its engine ready) since then
            "gpus": rows,
            "engine": last[1].to_json() if last else None,
            "engine_age_s": now - last[0] if last else None,
            "engine_down_in_window": any(
                not st.up or st.restarting for ts, st in engine if ts > start
            ),
            "idle_in_window": any(  # nothing to send at some point: work began inside it
                not (st.inflight or st.active_batches) for ts, st in engine if ts > start
            ),
            "tokens": tokens,
            "tokens_total": tokens_total,
            "tokens_per_s": tokens_per_s,
            "power_w": power_w,
            "j_per_token": power_w / tokens_per_s if power_w and tokens_per_s > 0 else None,
            "telemetry_available": available,
            "telemetry_reason": reason,
        }


def _gpu_summary(samples: list[GpuSample]) -> dict[str, Any] | None:
    """Mean power from the energy counter delta; the mean of readings when there is no counter
    (or it went backwards, as after a driver reload) or fewer than two samples."""
    if not samples:
        return None
    first, last = samples[0], samples[-1]
    span = last.ts - first.ts
    power_w, source = sum(s.power_w for s in samples) / len(samples), "readings"
    delta_j: float | None = power_w * span if span > 0 else None
    if first.energy_j is not None and last.energy_j is not None and span > 0:
        if last.energy_j >= first.energy_j:
            delta_j = last.energy_j - first.energy_j
            power_w, source = delta_j / span, "energy"
    limit = last.power_limit_w
    return {
        "gpu_uuid": last.gpu_uuid,
        "gpu_name": last.gpu_name,
        "samples": len(samples),
        "span_s": span,
        "power_w": power_w,
        "power_source": source,
        "last_power_w": last.power_w,
        "power_limit_w": limit,
        "default_power_limit_w": last.default_power_limit_w,
        "share_of_limit": power_w / limit if limit > 0 else None,
        "energy_j": last.energy_j,
        "energy_delta_j": delta_j,
        "utilization_pct": last.utilization_pct,
        "memory_used_mib": last.memory_used_mib,
        "memory_total_mib": last.memory_total_mib,
        "sm_clock_mhz": last.sm_clock_mhz,
        "temperature_c": last.temperature_c,
        "last_ts": last.ts,
    }


def _process(proc: Any) -> dict[str, Any]:
    return {"pid": int(proc.pid), "used_memory_mib": _scaled(proc.usedGpuMemory, 1 / 2**20)}


def _text(value: str | bytes) -> str:
    return value.decode() if isinstance(value, bytes) else value


def _scaled(value: Any, factor: float) -> float | None:
    return None if value is None else float(value) * factor
