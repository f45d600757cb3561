"""Where a run stands: Redis's progress copy says what is done, and how fast it goes.

The store is the truth (a batch is done when its output object exists), Redis holds a copy
kept by the workers and repaired from the store's listing (`common/progress.py`): `status`
reads the copy in O(1); `status --verify` lists the store first. Failed batches, token
counters and the throughput window come from Redis.
"""

from __future__ import annotations

from typing import Any

import redis

from genfleet.common import (
    findings,
    fleet_registry,
    keys,
    model_identity,
    progress,
    quality_gate,
    summaries,
)
from genfleet.common.engine_alarms import of_queue as alarms_of_queue
from genfleet.common.errors import InputError
from genfleet.common.ledger import Ledger
from genfleet.common.queue_depth import queue_depth
from genfleet.common.redis_conn import server_time
from genfleet.common.routing import ModelRef, work_queue
from genfleet.common.settings import Settings
from genfleet.common.store import Store
from genfleet.common.throughput import run_tokens_per_s

WINDOW_S = 120.0


def energy_figures(counters: dict[str, str], gpu_hour_cost: float | None) -> dict[str, Any]:
    """What the run's GPUs spent, from the workers' per-batch counters: kWh, J per generated
    token, GPU-hours and, given a price per GPU-hour, the cost per million generated tokens.

    J/token covers only the batches whose GPUs had an energy counter (`energy_batches` says
    how many); figures are None until there is something to divide by, never a made-up 0.

        energy_figures({"energy_j": "7.2e6", "energy_batches": "4", "energy_batch_tokens":
                        "2000000", "energy_tokens": "2000000", "gpu_s": "3600"}, 2.5)
        # → 2.0 kWh, 3.6 J/token, 1.0 GPU-hour, 1.25 USD per million tokens
    """
    energy_j = float(counters.get("energy_j", 0.0))
    batches = int(counters.get("energy_batches", 0))
    energy_tokens = int(counters.get("energy_batch_tokens", 0))
    tokens = int(counters.get("energy_tokens", 0))
    gpu_hours = float(counters.get("gpu_s", 0.0)) / 3600
    cost = None
    if gpu_hour_cost is not None and tokens > 0:
        cost = gpu_hours * gpu_hour_cost / (tokens / 1e6)
    return {
        "energy_kwh": energy_j / 3.6e6 if batches else None,
        "j_per_token": energy_j / energy_tokens if energy_tokens else None,
        "energy_batches": batches,
        "gpu_hours": gpu_hours if tokens else None,
        "gpu_hour_cost": gpu_hour_cost,
        "cost_per_million_tokens": cost,
    }


def energy_text(figures: dict[str, Any]) -> str:
    """One line for a terminal, '' when nothing was measured."""
    parts = []
    if figures["energy_kwh"] is not None:
        parts.append(f"{figures['energy_kwh']:.4g} kWh")
    if figures["j_per_token"] is not None:
        parts.append(f"{figures['j_per_token']:.4g} J/token")
    if figures["gpu_hours"] is not None:
        parts.append(f"{figures['gpu_hours']:.4g} GPU-hours")
    if figures["cost_per_million_tokens"] is not None:
        parts.append(f"{figures['cost_per_million_tokens']:.4g} USD per million tokens")
    return ", ".join(parts)


def engine_alarms(client: redis.Redis, queue: str) -> list[dict[str, Any]]:
    """The engines of `queue`'s workers that need a person, as the workers published them
    (`common.engine_alarms`): restart budget spent (in a cool-down) or a crash loop."""
    return alarms_of_queue(client, queue)


def engine_alarm_text(alarm: dict[str, Any], now: float) -> str:
    """`gpu-0@node: crash loop (3 times): RuntimeError: … — --disable-cuda-graph avoids it`,
    or `gpu-0@node: restart budget spent (5 in 3600 s), not taking work, back in 540 s: …`."""
    crash = alarm.get("crash") or {}
    error = crash.get("error") or "no error line in its log"
    fix = f" — {crash['what']}: {crash['workaround']}" if crash.get("workaround") else ""
    age = f" (reported {now - float(alarm.get('ts') or now):.0f} s ago)"
    if crash.get("loop"):
        head = f"crash loop, the same error {crash.get('repeats')} times: {error}{fix}"
        if not fix:
            head += " — a restart will not fix it: read the engine log"
    elif crash.get("flaky"):
        head = f"flaky, a different error on each of its last deaths, the last: {error}{fix}"
    else:
        head = f"{error}{fix}"
    if alarm.get("exhausted"):
        left = alarm.get("cooldown_left_s")
        back = f"back in {left:.0f} s" if isinstance(left, int | float) else "no cool-down"
        head = (
            f"restart budget spent ({alarm.get('restarts_in_window')} restarts in "
            f"{float(alarm.get('restart_window_s') or 0):.0f} s), not taking work, {back}: " + head
        )
    return f"{alarm.get('worker')}: {head}{age}"


def run_status(
    store: Store,
    client: redis.Redis,
    run: str,
    now: float | None = None,
    gpu_hour_cost: float | None = None,
    verify: bool = False,
    queue_prefix: str = "gpu",
) -> dict[str, Any]:
    """Where `run` stands, from Redis's progress copy in a few round trips, whatever the run's
    size; with `verify` (or when Redis holds no reconciled copy) the store's outputs are
    listed first and the copy repaired from them (`common/progress.py`)."""
    keys.validate_run(run)
    # Redis's clock: the start, the last batch's end and the tok/s buckets are stamped by it.
    now = server_time(client) if now is None else now
    snap = None if verify else progress.snapshot(client, run)
    ledger = Ledger(client)
    if snap is None:
        verified = progress.verify(store, client, run, now)
        if verified is None:
            raise InputError(f"no run {run!r} in {store.url} (no manifest): enqueue it first")
        ledger.unfail_done(run, verified.listed)
        snap = verified.snapshot
    summary = snap.summary
    failed, failed_n = ledger.failed_sample(run, FAILED_SHOWN)
    finished = progress.done_among(client, run, failed)
    failed = {batch: error for batch, error in failed.items() if batch not in finished}
    failed_n -= len(finished)
    counters = snap.counters
    prompts_done = snap.prompts_done
    done_n = snap.batches_done
    total = int(summary["batches_total"])
    prompts_total = int(summary["prompts_total"])
    started_at = float(counters["started_at"]) if "started_at" in counters else None
    paused = quality_gate.paused(client, run)
    if done_n == total:
        state = "done"
    elif paused is not None:
        state = "paused"
    elif client.exists(keys.cancelled_key(run)):
        state = "cancelled"
    elif failed_n and done_n + failed_n == total:
        state = "failed"
    elif done_n or started_at:
        state = "running"
    else:
        state = "queued"
    rate = run_tokens_per_s(client, run, now, WINDOW_S, started_at) if state == "running" else 0.0
    completion_tokens = int(counters.get("completion_tokens", 0))
    # generated: prompts answered so far, running batches included (live, from the workers)
    generated = min(max(int(counters.get("prompts_generated", 0)), prompts_done), prompts_total)
    eta_s: float | None = None
    answered = int(counters.get("prompts_generated", 0))
    if state == "done":
        eta_s = 0.0
    elif rate > 0 and answered:
        tokens_per_prompt = int(counters.get("tokens_generated", 0)) / answered
        eta_s = round((prompts_total - generated) * tokens_per_prompt / rate, 1)
    duration_s = None
    if started_at and "last_done_at" in counters:
        end = float(counters["last_done_at"]) if state in {"done", "failed"} else now
        duration_s = round(max(end - started_at, 0.0), 1)
    mean = round(completion_tokens / duration_s, 1) if duration_s else None
    if state in {"done", "failed"} and mean is not None:
        rate = mean  # a finished run's pace is its mean, not the 0 of a run that stopped
    return {
        "run": run,
        "state": state,
        "model": summary["model"],
        "engine": summary["engine"],
        "created_at": summary["created_at"],
        "batches_total": total,
        "batches_done": done_n,
        "batches_failed": failed_n,
        "prompts_total": prompts_total,
        "prompts_done": prompts_done,
        "prompts_generated": generated,
        "errors": int(counters.get("errors", 0)),
        "rejects": summary["rejects"],
        "sources_unread": summary.get("sources_unread", []),
        "rows_unread": summary.get("rows_unread", 0),
        "completion_tokens": completion_tokens,
        "reasoning_tokens": int(counters.get("reasoning_tokens", 0)),
        "tokens_per_s": round(rate, 1),
        "duration_s": duration_s,
        "mean_tokens_per_s": mean,
        "eta_s": eta_s,
        "failed": failed,
        "engine_alarms": engine_alarms(
            client,
            work_queue(queue_prefix, ModelRef(str(summary["engine"]), str(summary["model"]))),
        ),
        # Workers of the run's queue that do not serve its model, and why (a worker notes its
        # refusal as it hands the run's orders back): `unconsumed_queue` says when it is all.
        "model_refusals": model_identity.refusals(client, run),
        "store": store.url,
        "reconciled_at": snap.reconciled_at,
        **energy_figures(counters, gpu_hour_cost),
        "waste": run_waste(counters),
        "quality": run_quality(client, run, counters),
        "paused": paused,
    }


# A run's failed batches shown by `status`: their count is exact, their errors a sample, so
# that a run with 4,000 failed batches answers as fast as one with four.
FAILED_SHOWN = 100


def run_quality(client: redis.Redis, run: str, counters: dict[str, str]) -> dict[str, Any]:
    """What the run's answers are worth (common/quality.py): so far, from the workers'
    counters, and over its last `window_answers` answers (the gate's window, since the run
    was last enqueued), by the run's gate settings."""
    from genfleet.common.quality import GateSettings, QualityTally, figures

    gate = quality_gate.settings_of(client, run, GateSettings())
    window = quality_gate.read_window(client, run, gate.window_answers)
    return {
        "so_far": figures(QualityTally.from_counters(counters)),
        "window": figures(window),
        "gate": gate.to_json(),
    }


def run_waste(counters: dict[str, str]) -> dict[str, Any]:
    """Where the run's tokens went so far (common/waste.py), from the workers' counters, with
    energy per kind where the GPUs had an energy counter."""
    from genfleet.common.waste import WasteTally

    j_per_token = energy_figures(counters, None)["j_per_token"]
    return WasteTally.from_counters(counters).figures(j_per_token)


def read_findings(client: redis.Redis, run: str | None = None, count: int = 200) -> list[Any]:
    """Recent power-watch findings, newest first; with `run`, those about it or fleet-wide."""
    return [
        data
        for data in findings.recent(client, count)
        if run is None or data.get("run") in (None, run)
    ]


STALL_CAUSES = (
    "crash_loop",
    "restart_budget_spent",
    "engine_stalled",
    "engine_down",
    "worker_unresponsive",
)


def unconsumed_queue(
    queue: str,
    model: str,
    engine: str,
    prefix: str,
    worker_queues: dict[str, list[str]] | None,
    loading: dict[str, str] | None = None,
    refused: dict[str, str] | None = None,
) -> dict[str, Any] | None:
    """Why a run's orders sit untaken: no live worker consumes its `queue`, or every one that
    does refused the run's model (`refused`: worker → why, `common.model_identity`). None when
    a worker serves it, when one is loading its engine to consume the queue (`loading`: worker
    → the queue it will consume), or when the workers could not be asked (`worker_queues`
    None).

    Runs go to their model's queue (`gpu.emulator`, `gpu.<model>`): a run enqueued for a
    model the fleet does not serve waits forever unless someone is told. A worker loading its
    engine (minutes for a large model) does not consume yet, and is not to be told to start.

        unconsumed_queue("gpu.q3", "q3", "sglang", "gpu", {"w@h": ["gpu.emulator"]})["message"]
        # 'no live worker consumes queue gpu.q3 (model q3); workers consume: gpu.emulator. …'
        unconsumed_queue("gpu.emulator", "emulator", "emulator", "gpu",
                         {"w@h": ["gpu.emulator"]}, refused={"w@h": "quantization: …"})
        # {'held': True, 'message': "orders held: no worker serves the run's model: …", …}
    """
    if worker_queues is None or queue in (loading or {}).values():
        return None
    consumed = sorted(
        {q for qs in worker_queues.values() for q in qs if q.startswith(f"{prefix}.")}
    )
    if queue in consumed:
        return held_orders(queue, model, worker_queues, refused or {})
    start = "--engine emulator" if engine == "emulator" else f"--model {model}"
    if consumed:
        seen = f"workers consume: {', '.join(consumed)}"
        other = (
            "enqueue for their model under a new --run (`--engine emulator` for "
            f"{prefix}.emulator, `--model NAME` for a real model), or "
        )
    else:
        seen = f"{'no worker answered' if not worker_queues else 'no worker consumes a work queue'}"
        other = ""
    return {
        "queue": queue,
        "model": model,
        "worker_queues": consumed,
        "workers_answering": len(worker_queues),
        "message": (
            f"no live worker consumes queue {queue} (model {model}); {seen}. Its orders wait "
            f"until one does: {other}start a worker for it with `genfleet worker {start}`"
        ),
    }


def held_orders(
    queue: str, model: str, worker_queues: dict[str, list[str]], refused: dict[str, str]
) -> dict[str, Any] | None:
    """The run's orders are held when every live worker of its queue refused its model: they
    go round the queue (handed back by each) until a worker that serves the model comes."""
    consumers = sorted(w for w, qs in worker_queues.items() if queue in qs)
    if not consumers or any(w not in refused for w in consumers):
        return None
    each = "; ".join(f"{w}: {refused[w]}" for w in consumers[:5])
    more = f"; and {len(consumers) - 5} more" if len(consumers) > 5 else ""
    return {
        "queue": queue,
        "model": model,
        "worker_queues": [queue],
        "workers_answering": len(worker_queues),
        "held": True,
        "refused_by": {w: refused[w] for w in consumers},
        "message": (
            f"orders held: no worker serves the run's model. Every worker consuming {queue} "
            f"refused it ({each}{more}); its orders wait in the queue, not failed, until a "
            f"worker started with the settings the run was staged with takes them"
        ),
    }


def stall_reason(
    report: dict[str, Any],
    *,
    still_s: float,
    workers_seen: dict[str, float],
    findings: list[dict[str, Any]],
    queue_depth: int,
    now: float,
    unconsumed: dict[str, Any] | None = None,
    loading: list[str] | None = None,
) -> str:
    """Why a run that has not moved for `still_s` is stuck, the most specific cause first
    (`loading`: the workers still loading their engine for the run's queue).

    >>> stall_reason({"batches_failed": 0}, still_s=300, workers_seen={}, findings=[],
    ...              queue_depth=4, now=1000.0)[:47]
    'nothing has moved for 300 s: no worker answered'
    """
    head = f"nothing has moved for {still_s:.0f} s: "
    recent = [f for f in findings if now - float(f.get("ts", 0)) <= still_s]
    for finding in recent:
        if finding.get("cause") in STALL_CAUSES:
            return (
                f"{head}{finding['cause'].replace('_', ' ')} on {finding.get('worker')} "
                f"({finding.get('suggestion')})"
            )
    if unconsumed is not None:
        return head + str(unconsumed["message"])
    if loading:
        names = ", ".join(loading[:5]) + (", …" if len(loading) > 5 else "")
        workers = f"{len(loading)} worker{'s' if len(loading) > 1 else ''}"
        return (
            f"{head}{workers} still loading the engine for this run ({names}), {queue_depth} "
            "orders queued for them: see `genfleet top` and the workers' logs"
        )
    alive = sorted(w for w, ts in workers_seen.items() if now - ts <= still_s)
    if not alive:
        return (
            f"{head}no worker answered in that time ({queue_depth} orders queued): start one "
            "with `genfleet worker`, and `genfleet control` for the power-watch"
        )
    failed = int(report.get("batches_failed", 0))
    if failed and queue_depth == 0:
        return (
            f"{head}the {failed} failed batches are all that is left besides running ones: "
            "see `genfleet status`, fix the cause, then `genfleet retry`"
        )
    return (
        f"{head}{len(alive)} workers answer and {queue_depth} orders are queued, but nothing "
        "finishes: read the workers' and engines' logs"
    )


def stall_facts(
    client: redis.Redis, run: str, queue: str, summary_ttl_s: float | None = None
) -> dict[str, Any]:
    """What `stall_reason` needs from Redis: workers seen by the power-watch, recent findings,
    the work queue's depth and, given the summaries' TTL, the workers loading their engine
    for `queue`."""
    seen = fleet_registry.seen(client)
    depth = queue_depth(client, queue)
    starting = loading_workers(client, summary_ttl_s) if summary_ttl_s else {}
    return {
        "workers_seen": seen,
        "findings": read_findings(client, run),
        "queue_depth": depth,
        "loading": sorted(w for w, q in starting.items() if q == queue),
    }


def loading_workers(client: redis.Redis, ttl_s: float) -> dict[str, str]:
    """Workers whose engine is still loading, by worker: the queue each will consume once it
    is up. A worker answers `worker_queues` only once it consumes, and an engine loads for
    minutes, so these come from the summaries workers push from their start
    (`common.summaries`), heard within `ttl_s` (one that died loading goes silent). {} when
    Redis cannot be read: no claim either way."""
    try:
        return summaries.read(client, ttl_s).loading()
    except redis.RedisError:
        return {}


def run_is_held(client: redis.Redis, run: str) -> bool:
    """Whether a live worker holds a batch of `run` now (a running entry whose lease is
    alive): work goes on even while no prompt finishes (a long completion, a slow store)."""
    leases = [keys.lease_key(run, batch) for batch in Ledger(client).running_batches(run)]
    return bool(leases) and bool(client.exists(*leases))


def wait_deadline_s(settings: Settings) -> float:
    """How long `run` and `status --watch` wait with no prompt finished and no batch held:
    `wait_deadline_leases` leases, or the engine's start-up time if longer (a worker loading
    its engine holds no batch yet)."""
    return max(settings.wait_deadline_leases * settings.lease_ttl_s, settings.startup_timeout_s)
