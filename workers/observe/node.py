"""Every GPU of every node accounted for: GPUs no worker claims, and memory held by strangers.

Each worker reports, besides its own GPUs, every GPU of its node (`node_gpus` in its
`gpu_report`: UUID, power, memory used, and the compute processes NVML lists, each marked
`engine` True/False by the worker, or None where the worker cannot tell, as when NVML's pids
live in another pid namespace). `node_rows` judges them with the fleet's reports, purely:

    unclaimed_gpu    a GPU of a node where genfleet workers run that none of them claims:
                     a worker that never started (a typo in --gpus, a crashed child)
    foreign_process  a process that is not the worker's engine holds memory on its GPU: the
                     engine gets less KV cache, or cannot start at all

Called by the beat's power-watch and by `genfleet top`, next to `diagnosis.diagnose`.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from genfleet.workers.observe.diagnosis import Finding, FleetState

NODE_CAUSES = ("unclaimed_gpu", "foreign_process")

_SUGGESTIONS = {
    "unclaimed_gpu": (
        "drawing {power_w:.0f} W, no genfleet worker on {node}: start one for this GPU "
        "(check --gpus and the worker's log) or take the GPU out of the fleet"
    ),
    "foreign_process": (
        "pid {pid} ({name}) holds {memory_used_mib:.0f} MiB on this worker's GPU and is not its "
        "engine: stop it, the engine gets less KV cache"
    ),
}


def _row(worker: str, gpu: Mapping[str, Any], verdict: str) -> dict[str, Any]:
    return {
        "worker": worker,
        "gpu_uuid": gpu.get("gpu_uuid"),
        "gpu_name": gpu.get("gpu_name"),
        "power_w": gpu.get("power_w"),
        "power_limit_w": gpu.get("power_limit_w"),
        "tokens_per_s": None,
        "inflight": None,
        "inflight_cap": None,
        "accept_length": None,
        "j_per_token": None,
        "verdict": verdict,
        "cause": verdict,
    }


def _finding(
    worker: str, gpu_uuid: Any, cause: str, numbers: dict[str, Any], now: float
) -> Finding:
    return Finding(
        worker=worker,
        gpu_uuid=str(gpu_uuid) if gpu_uuid else None,
        verdict=cause,
        cause=cause,
        numbers=numbers,
        suggestion=_SUGGESTIONS[cause].format(**numbers),
        ts=now,
    )


def _fresh(samples: Mapping[str, Mapping[str, Any]], now: float, stale_after_s: float) -> list[str]:
    return [w for w in sorted(samples) if now - float(samples[w].get("ts", now)) <= stale_after_s]


def _unclaimed(
    samples: Mapping[str, Mapping[str, Any]], workers: list[str], fleet: FleetState, now: float
) -> list[tuple[dict[str, Any], Finding]]:
    claimed = {str(g.get("gpu_uuid")) for w in workers for g in samples[w].get("gpus") or []} | {
        str(u) for w in workers for u in samples[w].get("gpu_uuids") or []
    }
    seen: dict[str, tuple[str, Mapping[str, Any], list[str]]] = {}
    for worker in workers:
        node = str(samples[worker].get("node") or worker)
        if node in fleet.starting_nodes:
            continue  # a worker there has not said which GPUs it claims yet
        for gpu in samples[worker].get("node_gpus") or []:
            uuid = str(gpu.get("gpu_uuid"))
            if uuid in claimed:
                continue
            _, _, reporters = seen.setdefault(uuid, (node, gpu, []))
            reporters.append(worker)
    out = []
    for uuid, (node, gpu, reporters) in sorted(seen.items()):
        label = f"{node} (no worker)"
        numbers = {
            "node": node,
            "gpu_uuid": uuid,
            "index": gpu.get("index"),
            "power_w": float(gpu.get("power_w") or 0.0),
            "power_limit_w": gpu.get("power_limit_w"),
            "memory_used_mib": gpu.get("memory_used_mib"),
            "processes": len(gpu.get("processes") or []),
            "reported_by": reporters,
        }
        out.append(
            (
                _row(label, gpu, "unclaimed_gpu"),
                _finding(label, uuid, "unclaimed_gpu", numbers, now),
            )
        )
    return out


def _foreign(
    samples: Mapping[str, Mapping[str, Any]], workers: list[str], now: float
) -> list[tuple[dict[str, Any], Finding]]:
    out = []
    for worker in workers:
        mine = {str(g.get("gpu_uuid")) for g in samples[worker].get("gpus") or []}
        for gpu in samples[worker].get("node_gpus") or []:
            if str(gpu.get("gpu_uuid")) not in mine:
                continue
            for proc in gpu.get("processes") or []:
                if proc.get("engine") is not False or not (proc.get("used_memory_mib") or 0):
                    continue
                numbers = {
                    "pid": proc.get("pid"),
                    "name": proc.get("name") or "?",
                    "memory_used_mib": float(proc["used_memory_mib"]),
                    "gpu_memory_used_mib": gpu.get("memory_used_mib"),
                    "power_w": gpu.get("power_w"),
                }
                row = _row(worker, gpu, "foreign_process")
                finding = _finding(worker, gpu.get("gpu_uuid"), "foreign_process", numbers, now)
                out.append((row, finding))
    return out


def node_rows(
    samples: Mapping[str, Mapping[str, Any]],
    fleet_state: FleetState | Mapping[str, Any],
    now: float,
    stale_after_s: float = 90.0,
) -> list[tuple[dict[str, Any], Finding]]:
    """A `top` row and a finding for every GPU no worker claims (one per GPU, however many
    workers of its node report it) and every foreign process on a worker's GPU. Stale
    reports are left out (a worker that stopped answering is the diagnosis' finding), and so
    are nodes where a worker's engine is still starting."""
    fleet = FleetState.coerce(fleet_state)
    workers = _fresh(samples, now, stale_after_s)
    return _unclaimed(samples, workers, fleet, now) + _foreign(samples, workers, now)
