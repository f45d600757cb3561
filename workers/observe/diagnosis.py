"""The power-watch diagnosis: which GPUs are underused while work waits, and why.

"GPU utilisation %" hides underuse (an H200 read 98 % at 527 W of 700 W on a memory-bound
load); power against the enforced limit does not. The beat task `power_watch` gathers every
worker's `TelemetryWindow.summary(now)`, joins the fleet's queue state and calls `diagnose`.
Everything here is pure: samples, fleet state and `now` in, findings out.

A GPU is underused when its mean power over the window is below `threshold × enforced limit`
while work waits for it (the queue holds work orders, or its worker has requests or batches
in flight). The cause is the first that applies, in this order:

    crash_loop       the engine died with the same last error on consecutive restarts: a
                     restart will not fix it (a known engine crash is named with its
                     workaround); a finding whether or not work waits
    restart_budget_spent  the engine's restart budget (a rate) is spent: the worker takes no
                     work until its cool-down ends; a finding whether or not work waits
    engine_down      the engine is down or restarting, now or during the window
    mtp_off          speculative decoding is off (speculative_algorithm is None), though the
                     engine plan did not turn it off for this card (`mtp_planned_off`); never
                     where engine_capped applies: drafts do not raise the engine's cap
    mtp_ineffective  accept length below min_accept_length: MTP weights likely missing
    engine_capped    the engine holds work it does not run: it runs its enforced cap with work
                     waiting for it (queued inside it, more in flight than running, or more
                     the client would send), or it queues requests below its cap (its KV cache
                     admits no more). The finding names what set the cap (`cap_limit`:
                     "configured", "state_pool" — the recurrent-state pool of a hybrid model —
                     or "kv") and the fix: the engine plan's flags (`plan_fix`) when the cap is
                     below the plan's (`plan_cap`), else that limit's usual fix
    client_limited   work waits for this GPU (orders in the queue, or its worker's limiter
                     full) while the engine has room: below its cap, nothing queued inside it
    unbalanced       the queue is empty while another worker holds prompts it has not sent
                     yet (reserved batches): the work sits on one GPU while this one idles
    starved          the queue is empty while a run is still staging: the producer is slower
                     than the fleet

A GPU finishing a run's last batches (queue empty, every run done staging, no other worker
holding unsent prompts) is `draining`: the end of a run, not a finding. A run counts as
staging only once it has staged for longer than the power window, so the idle minute before
the first batch arrives is not blamed on the producer. Likewise a GPU whose worker had
nothing to send at some point of the window (`idle_in_window`: work began inside it) is
`starting`, not blamed on MTP or feeding; the next full window judges it.

A GPU whose engine runs its cap, the cap at or above the one the engine plan expects of this
card (`plan_cap`), is "ok" whatever its power: memory-bound decode at the plan's best batch
draws what it draws, and no knob of the worker raises it. Capped below the plan's cap with
work waiting it is underused, `engine_capped`, with the plan's fix, whatever its power too:
there the plan, not the power, is the tell (an H200 whose engine ran 48 requests drew 83 % of
its limit, above the threshold, where the plan's 256 drew 2.47 times the tokens).

MTP off is blamed when spec is off even where feeding is also short: the other causes that
apply are listed in `numbers["other_causes"]`. An accept length below the minimum is a
finding even when power is fine (verdict "mtp_ineffective"): the checkpoint lacks its MTP
weights and SGLang does not say so. Underused with no work waiting is "idle", not a finding.
An expected worker with no summary, or a stale one, is `worker_unresponsive` (a silent one's
`summary_age_s`: how long since it last pushed its summary).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass, field
from typing import Any

from genfleet.workers.engine.crashes import crash_suggestion
from genfleet.workers.observe.engine_state import accept_length_judges_mtp
from genfleet.workers.observe.headlines import engine_alarm_line, waiting_work

CAUSES = (
    "crash_loop",
    "restart_budget_spent",
    "engine_down",
    "mtp_off",
    "mtp_ineffective",
    "engine_capped",
    "client_limited",
    "unbalanced",
    "starved",
    "worker_unresponsive",
)
VERDICTS = (
    "ok",
    "idle",
    "starting",
    "draining",
    "underused",
    "mtp_ineffective",
    "unresponsive",
    "unknown",
)


@dataclass(frozen=True)
class Finding:
    """One diagnosis worth telling someone about, with the figures behind it."""

    worker: str
    gpu_uuid: str | None
    verdict: str
    cause: str
    numbers: dict[str, Any]
    suggestion: str
    ts: float
    run: str | None = None

    def fingerprint(self) -> str:
        """Identity for de-duplication: the same worker, GPU and cause is the same finding."""
        return f"{self.worker}|{self.gpu_uuid or '-'}|{self.cause}"

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> Finding:
        return cls(**dict(data))


@dataclass(frozen=True)
class FleetState:
    """What the beat knows about the queue: messages waiting in the Redis work queue
    (`queue_depth`), batches without output per run (`pending_batches`), the workers
    expected to answer (seen recently), the runs still staging (run → when staging
    started; a run leaves it when its manifest is written), and the nodes where a worker's
    engine is still starting (its GPUs are not reported as claimed yet)."""

    queue_depth: int = 0
    pending_batches: Mapping[str, int] = field(default_factory=dict)
    expected_workers: frozenset[str] = frozenset()
    staging: Mapping[str, float] = field(default_factory=dict)
    starting_nodes: frozenset[str] = frozenset()
    # Expected workers whose pushed summary is older than its TTL: how long (Redis's clock).
    silent_s: Mapping[str, float] = field(default_factory=dict)

    @classmethod
    def coerce(cls, value: FleetState | Mapping[str, Any]) -> FleetState:
        """Accept the dataclass or its JSON shape (the keys above, workers as a list)."""
        if isinstance(value, FleetState):
            return value
        return cls(
            queue_depth=int(value.get("queue_depth", 0)),
            pending_batches=dict(value.get("pending_batches", {})),
            expected_workers=frozenset(value.get("expected_workers", ())),
            staging={str(k): float(v) for k, v in dict(value.get("staging", {})).items()},
            starting_nodes=frozenset(value.get("starting_nodes", ())),
            silent_s={str(k): float(v) for k, v in dict(value.get("silent_s", {})).items()},
        )

    def to_json(self) -> dict[str, Any]:
        return {
            "queue_depth": self.queue_depth,
            "pending_batches": dict(self.pending_batches),
            "expected_workers": sorted(self.expected_workers),
            "staging": dict(self.staging),
            "starting_nodes": sorted(self.starting_nodes),
            "silent_s": dict(self.silent_s),
        }

    def staging_for(self, now: float, at_least_s: float) -> list[str]:
        """Runs that have been staging for at least `at_least_s` seconds."""
        return sorted(run for run, since in self.staging.items() if now - since >= at_least_s)


_SUGGESTIONS = {
    "crash_loop": "the engine dies the same way on every restart ({crash_repeats} times: "
    "{crash_error}): {crash_fix}",
    "restart_budget_spent": (
        "the engine's restart budget is spent ({restarts_in_window} restarts in "
        "{restart_window}): no work taken until its cool-down ends in {cooldown_left}; last "
        "error: {crash_error}"
    ),
    "engine_down": "the engine is down or restarting: read the worker's engine log",
    "mtp_off": "speculative decoding is off: run with MTP on (--mtp) if the model has MTP heads",
    "mtp_ineffective": (
        "accept length {accept_length:.2f} < {min_accept_length}: the checkpoint likely lacks its "
        "MTP weights; check its safetensors index for MTP tensors"
    ),
    "engine_capped": "{cap_what}: {cap_fix}",
    "client_limited": (
        "work waits ({waiting}) while {inflight}/{inflight_cap} requests are "
        "in flight: raise --max-inflight (or --worker-concurrency)"
    ),
    "unbalanced": (
        "the queue is empty while other workers hold {backlog_elsewhere} unsent prompts of "
        "their reserved batches: lower --worker-concurrency or --batch-size so work spreads"
    ),
    "starved": (
        "nothing queued while run(s) {staging} still stage: the producer is slower than the "
        "fleet (run several producers, stage ahead, or run fewer workers)"
    ),
    "worker_unresponsive": "the worker stopped answering: check its process, broker and engine",
}


@dataclass(frozen=True)
class EngineRoom:
    """Where an engine stands against its running-request cap, from its `EngineState` JSON
    and whether the client wants to send more (orders queued, or its limiter full).

    `full`: it runs its enforced cap. `capped`: it holds work it does not run, so the engine,
    not the client, is what limits it: at its cap with work waiting for it (queued inside
    it, more in flight than running, or the client wanting to send more), or below its cap
    with requests queued inside it (`below_cap`: its KV cache admits no more). `room`: it
    would run more than it is given (below its cap, nothing queued inside); an engine that
    reports neither figure is taken to have room, as the client cannot tell otherwise.
    `at_plan`: full at a cap at or above the plan's for this card: the best it can do.
    `short_of_plan`: capped at a cap below the plan's (an engine launched otherwise, or one
    that cut the plan): the card could run a larger batch, whatever its power reads.
    """

    full: bool
    capped: bool
    below_cap: bool
    room: bool
    at_plan: bool
    short_of_plan: bool

    @classmethod
    def of(cls, engine: Mapping[str, Any], wants_more: bool) -> EngineRoom:
        running, cap = engine.get("running"), engine.get("max_running_requests")
        queued = engine.get("queued") or 0
        inflight = engine.get("inflight") or 0
        full = running is not None and cap is not None and running >= cap
        held = full and (queued > 0 or inflight > (running or 0) or wants_more)
        below = not full and queued > 0
        plan = engine.get("plan_cap")
        return cls(
            full=full,
            capped=held or below,
            below_cap=below,
            room=not full and queued == 0,
            at_plan=full and plan is not None and cap is not None and cap >= plan,
            short_of_plan=(held or below) and plan is not None and cap is not None and cap < plan,
        )


def _wants_more(engine: Mapping[str, Any], fleet: FleetState) -> bool:
    """Work waits for this GPU on the client's side: orders in the queue, or its own limiter
    full (its batches are reserved, so the queue can look empty meanwhile)."""
    inflight, limit = engine.get("inflight") or 0, engine.get("inflight_cap") or 0
    return fleet.queue_depth > 0 or bool(limit and inflight >= limit)


def _causes(
    engine: Mapping[str, Any], down: bool, fleet: FleetState, min_accept_length: float, idle: str
) -> list[str]:
    """Every cause of underuse that applies, in precedence order; the last is `idle`, why the
    GPU lacks work when the client wants to send nothing more (see `_idle_cause`)."""
    found = []
    alarm = engine_alarm(engine)
    if alarm is not None:
        found.append(alarm)
    if down:
        found.append("engine_down")
    wants_more = _wants_more(engine, fleet)
    room = EngineRoom.of(engine, wants_more)
    # An engine without /server_info (a generic command) cannot say whether MTP is on:
    # blaming MTP there would send the operator after the wrong knob. Nor is it to blame
    # where the engine's cap limits it (drafts do not raise the cap), or where the engine
    # plan turned MTP off for this card.
    if (
        engine.get("spec_reported", True)
        and not engine.get("speculative_algorithm")
        and not engine.get("mtp_planned_off")
        and not room.capped
    ):
        found.append("mtp_off")
    accept = engine.get("accept_length")
    if (
        engine.get("speculative_algorithm")
        and accept is not None
        and accept < min_accept_length
        and accept_length_judges_mtp(
            bool(engine.get("speculative_adaptive")), engine.get("running")
        )
    ):
        found.append("mtp_ineffective")
    if room.capped:
        found.append("engine_capped")
    if not wants_more:
        found.append(idle)
    elif room.room:
        found.append("client_limited")
    return found


_STATE_POOL_FIX = (
    "--disable-radix-cache with a --max-running-requests that fits, or a larger "
    "--mamba-full-memory-ratio"
)
_KV_FIX = (
    "shorter answers (a lower max_tokens), an fp8 KV cache (--kv-cache-dtype fp8_e4m3) or a "
    "larger --mem-fraction-static"
)


def _capped_advice(
    engine: Mapping[str, Any], room: EngineRoom, fleet: FleetState
) -> dict[str, Any]:
    """What caps a capped engine and its fix, for the `engine_capped` finding: `cap_limit`
    (the engine's, or "kv" when it queues below its cap), `cap_what` (the limit in words,
    with what waits for it) and `cap_fix` (the plan's flags when the cap is below the plan's,
    else the usual fix for that limit)."""
    cap = engine.get("max_running_requests")
    running, queued = engine.get("running"), engine.get("queued") or 0
    configured, plan = engine.get("configured_max_running_requests"), engine.get("plan_cap")
    limit = "kv" if room.below_cap else engine.get("cap_limit") or "configured"
    inflight = engine.get("inflight") or 0
    if queued:
        waits = f"{queued} queued inside it"
    elif inflight > (running or 0):
        waits = f"{inflight - (running or 0)} more in flight"
    else:
        waits = waiting_work(fleet.queue_depth, engine.get("active_batches") or 0)
    of = f" ({configured} configured)" if configured and configured != cap else ""
    short = plan is not None and cap is not None and cap < plan
    expects = f"; the plan expects {plan} on this card" if short else ""
    if room.below_cap:
        now = f"{running} running, " if running is not None else ""
        what = f"the KV cache admits no more: {now}below the engine's cap of {cap}, {waits}"
        return {"cap_limit": limit, "cap_what": what, "cap_fix": _KV_FIX}
    if limit == "state_pool":
        what = f"the recurrent-state pool limits the engine to {cap} running requests{of}"
        fix = _STATE_POOL_FIX
    elif limit == "kv":
        what = f"the KV cache holds only {cap} running requests' tokens{of}"
        fix = _KV_FIX
    else:
        what = f"the engine runs its max_running_requests={cap}"
        fix = "raise --max-running-requests" + (f" to {plan}" if short else "")
    plan_fix = engine.get("plan_fix")
    if plan_fix and (plan is None or short):
        fix = str(plan_fix)
    return {"cap_limit": limit, "cap_what": f"{what}, {waits}{expects}", "cap_fix": fix}


def engine_alarm(engine: Mapping[str, Any]) -> str | None:
    """`crash_loop` or `restart_budget_spent` when the engine needs a person, else None."""
    if (engine.get("crash") or {}).get("loop"):
        return "crash_loop"
    if engine.get("exhausted"):
        return "restart_budget_spent"
    return None


def engine_headline(engine: Mapping[str, Any]) -> str:
    """The engine of one worker in a line, for the worker's Celery `stats` (Flower's worker
    page shows it): the alarm when it needs a person (`restart budget spent (5 in 3600 s),
    back in 540 s: RuntimeError: …`, `crash loop (3 times): …`), else its state and load
    (`ready: 48 of 64 in flight, 3 batches`). `engine` is an `EngineState` as JSON."""
    alarm = engine_alarm(engine)
    if alarm is not None:
        line = engine_alarm_line(alarm, _alarm_numbers(engine))
        return f"{alarm.upper().replace('_', ' ')}: {line}"
    if engine.get("restarting"):
        return f"restarting (restarts so far: {engine.get('restarts') or 0})"
    if not engine.get("up"):
        return "down"
    return (
        f"ready: {engine.get('inflight') or 0} of {engine.get('inflight_cap') or 0} in flight, "
        f"{engine.get('restarts_in_window') or 0} restarts in its window"
    )


def _alarm_numbers(engine: Mapping[str, Any]) -> dict[str, Any]:
    """The figures of an engine alarm, as the suggestions quote them."""
    crash = engine.get("crash") or {}
    left = engine.get("cooldown_left_s")
    window = engine.get("restart_window_s")
    return {
        "crash_error": crash.get("error") or "none in its log",
        "crash_repeats": crash.get("repeats") or 0,
        "crash_known": crash.get("known"),
        "crash_fix": crash_suggestion(crash) if crash else "",
        "restarts_in_window": engine.get("restarts_in_window") or 0,
        "restart_budget": engine.get("restart_budget"),
        "restart_window": f"{window:.0f} s" if window else "its window",
        "cooldown_left": f"{left:.0f} s" if left is not None else "a while",
    }


# Causes read from how the engine is fed, which a window that began idle cannot judge.
_FEEDING = ("mtp_off", "engine_capped", "client_limited")


def _idle_cause(backlog_elsewhere: int, staging: list[str]) -> str:
    """Why a GPU has nothing to do while the queue is empty: other workers sit on unsent
    prompts (`unbalanced`), a run is still staging (`starved`), or the run is ending
    (`draining`, not a finding)."""
    if backlog_elsewhere > 0:
        return "unbalanced"
    if staging:
        return "starved"
    return "draining"


def _work_waits(engine: Mapping[str, Any], fleet: FleetState) -> bool:
    return fleet.queue_depth > 0 or any(
        (engine.get(k) or 0) > 0 for k in ("inflight", "active_batches", "running", "queued")
    )


def _run_of(engine: Mapping[str, Any], fleet: FleetState) -> str | None:
    runs = list(engine.get("runs") or [])
    if len(runs) == 1:
        return str(runs[0])
    pending = [r for r, n in fleet.pending_batches.items() if n > 0]
    return pending[0] if not runs and len(pending) == 1 else None


def _low_power_verdict(
    causes: list[str],
    room: EngineRoom,
    waits: bool,
    summary: Mapping[str, Any],
    fleet: FleetState,
) -> tuple[str, str | None]:
    """The verdict and cause of a GPU below the power threshold whose engine is up: why its
    power is low decides whether that is a finding."""
    if not waits:
        ending = any(n > 0 for n in fleet.pending_batches.values())
        return ("draining" if ending else "idle"), None
    if room.at_plan:
        # At the cap the engine plan expects of this card: memory-bound decode at its best
        # batch draws what it draws; no knob of this worker would raise it.
        return "ok", None
    if causes[-1] == "draining" and "engine_capped" not in causes:
        # The run's last batches finish: low power says nothing about MTP or feeding.
        return "draining", None
    if summary.get("idle_in_window") and causes[0] in _FEEDING:
        # Work began inside the window: its mean still holds the idle time before it.
        return "starting", None
    return "underused", causes[0]


def _judge_gpu(
    worker: str,
    summary: Mapping[str, Any],
    gpu: Mapping[str, Any] | None,
    fleet: FleetState,
    now: float,
    threshold: float,
    min_accept_length: float,
    backlog_elsewhere: int = 0,
) -> tuple[dict[str, Any], Finding | None]:
    sampled = bool(summary.get("engine"))  # a worker that just started has no window yet
    engine = summary.get("engine") or {"up": False}
    down = not engine.get("up") or bool(engine.get("restarting"))
    down = sampled and (down or bool(summary.get("engine_down_in_window")))
    power = gpu.get("power_w") if gpu else None
    limit = gpu.get("power_limit_w") if gpu else None
    staging = fleet.staging_for(now, float(summary.get("window_s") or 0.0))
    idle = _idle_cause(backlog_elsewhere, staging)
    waits = _work_waits(engine, fleet) or idle != "draining"
    accept = engine.get("accept_length")
    numbers: dict[str, Any] = {
        "power_w": power,
        "power_limit_w": limit,
        "share_of_limit": power / limit if power is not None and limit else None,
        "threshold": threshold,
        "inflight": engine.get("inflight"),
        "inflight_cap": engine.get("inflight_cap"),
        "running": engine.get("running"),
        "queued": engine.get("queued"),
        "max_running_requests": engine.get("max_running_requests"),
        "configured_max_running_requests": engine.get("configured_max_running_requests"),
        "cap_limit": engine.get("cap_limit"),
        "plan_cap": engine.get("plan_cap"),
        "plan_fix": engine.get("plan_fix"),
        "speculative_algorithm": engine.get("speculative_algorithm"),
        "accept_length": accept,
        "min_accept_length": min_accept_length,
        "queue_depth": fleet.queue_depth,
        "active_batches": engine.get("active_batches"),
        "tokens_per_s": summary.get("tokens_per_s"),
        "backlog_elsewhere": backlog_elsewhere,
        "staging": ", ".join(staging),
    }
    alarm = engine_alarm(engine)
    if alarm is not None:
        numbers.update(_alarm_numbers(engine))
    causes = _causes(engine, down, fleet, min_accept_length, idle)
    room = EngineRoom.of(engine, _wants_more(engine, fleet))
    capped: dict[str, Any] = {}
    if "engine_capped" in causes:
        capped = _capped_advice(engine, room, fleet)
        numbers.update(cap_limit=capped["cap_limit"], cap_fix=capped["cap_fix"])
    low = power is not None and limit is not None and power < threshold * limit
    if alarm is not None:
        # Not a matter of power: the engine cannot serve until someone (or the cool-down)
        # acts, whether or not work waits right now.
        verdict, cause = ("underused" if waits else "idle"), alarm
    elif down and waits:
        verdict, cause = "underused", "engine_down"
    elif power is None or not limit:
        verdict, cause = "unknown", None
    elif low:
        verdict, cause = _low_power_verdict(causes, room, waits, summary, fleet)
    elif room.short_of_plan and waits and not summary.get("idle_in_window"):
        verdict, cause = "underused", "engine_capped"
    else:
        verdict, cause = "ok", None
    if cause is None and "mtp_ineffective" in causes:
        verdict, cause = "mtp_ineffective", "mtp_ineffective"
    if cause is not None:
        numbers["other_causes"] = [c for c in causes if c != cause]
    row = {
        "worker": worker,
        "gpu_uuid": gpu.get("gpu_uuid") if gpu else None,
        "gpu_name": gpu.get("gpu_name") if gpu else None,
        "power_w": power,
        "power_limit_w": limit,
        "tokens_per_s": summary.get("tokens_per_s"),
        "inflight": engine.get("inflight"),
        "inflight_cap": engine.get("inflight_cap"),
        "accept_length": accept,
        "j_per_token": summary.get("j_per_token"),
        "verdict": verdict,
        "cause": cause,
    }
    if cause is None:
        return row, None
    suggestion = _SUGGESTIONS[cause].format(
        **{**numbers, **capped},
        waiting=waiting_work(fleet.queue_depth, numbers["active_batches"] or 0),
    )
    if alarm is not None:
        row["why"] = suggestion  # `top` prints it under the table: the error and the fix
    finding = Finding(
        worker=worker,
        gpu_uuid=row["gpu_uuid"],
        verdict=verdict,
        cause=cause,
        numbers=numbers,
        suggestion=suggestion,
        ts=now,
        run=_run_of(engine, fleet),
    )
    return row, finding


def _unresponsive(worker: str, age_s: float | None, now: float) -> tuple[dict[str, Any], Finding]:
    row: dict[str, Any] = {
        "worker": worker,
        "gpu_uuid": None,
        "gpu_name": None,
        "power_w": None,
        "power_limit_w": None,
        "tokens_per_s": None,
        "inflight": None,
        "inflight_cap": None,
        "accept_length": None,
        "j_per_token": None,
        "verdict": "unresponsive",
        "cause": "worker_unresponsive",
    }
    finding = Finding(
        worker=worker,
        gpu_uuid=None,
        verdict="unresponsive",
        cause="worker_unresponsive",
        numbers={"summary_age_s": age_s},
        suggestion=_SUGGESTIONS["worker_unresponsive"],
        ts=now,
    )
    return row, finding


def _judge(
    samples: Mapping[str, Mapping[str, Any]],
    fleet_state: FleetState | Mapping[str, Any],
    now: float,
    threshold: float,
    min_accept_length: float,
    stale_after_s: float,
) -> list[tuple[dict[str, Any], Finding | None]]:
    fleet = FleetState.coerce(fleet_state)
    backlog = {w: _backlog(summary) for w, summary in samples.items()}
    total_backlog = sum(backlog.values())
    out: list[tuple[dict[str, Any], Finding | None]] = []
    for worker in sorted(fleet.expected_workers - set(samples)):
        out.append(_unresponsive(worker, fleet.silent_s.get(worker), now))
    for worker in sorted(samples):
        summary = samples[worker]
        age = now - float(summary.get("ts", now))
        if age > stale_after_s:
            out.append(_unresponsive(worker, age, now))
            continue
        elsewhere = total_backlog - backlog[worker]
        for gpu in summary.get("gpus") or [None]:
            out.append(
                _judge_gpu(
                    worker, summary, gpu, fleet, now, threshold, min_accept_length, elsewhere
                )
            )
    return out


def _backlog(summary: Mapping[str, Any]) -> int:
    """Prompts a worker holds in its reserved batches but has not sent to its engine yet."""
    engine = summary.get("engine") or {}
    return int(engine.get("waiting") or 0)


def diagnose(
    samples: Mapping[str, Mapping[str, Any]],
    fleet_state: FleetState | Mapping[str, Any],
    now: float,
    threshold: float = 0.70,
    min_accept_length: float = 1.2,
    stale_after_s: float = 90.0,
) -> list[Finding]:
    """Findings for every GPU that is underused while work waits, every engine whose MTP does
    not accept drafts, and every worker that stopped answering.

    `samples` maps worker name → its `TelemetryWindow.summary(now)` (at least `ts`, `gpus`,
    `engine`); `fleet_state` is a `FleetState` or its JSON. A worker without GPU rows (no
    NVML) is judged on its engine alone. `stale_after_s` is about three beat intervals.
    """
    rows = _judge(samples, fleet_state, now, threshold, min_accept_length, stale_after_s)
    return [f for _, f in rows if f is not None]


def verdicts(
    samples: Mapping[str, Mapping[str, Any]],
    fleet_state: FleetState | Mapping[str, Any],
    now: float,
    threshold: float = 0.70,
    min_accept_length: float = 1.2,
    stale_after_s: float = 90.0,
) -> list[dict[str, Any]]:
    """One row per GPU for `genfleet top` (healthy ones included): worker, gpu_uuid, gpu_name,
    power_w, power_limit_w, tokens_per_s, inflight, inflight_cap, accept_length, j_per_token,
    verdict, cause. Same rules as `diagnose`."""
    rows = _judge(samples, fleet_state, now, threshold, min_accept_length, stale_after_s)
    return [row for row, _ in rows]


def dedupe(
    findings: Iterable[Finding],
    last_alerted: Mapping[str, float],
    now: float,
    realert_after_s: float,
) -> tuple[list[Finding], dict[str, float]]:
    """The findings to alert on now, and the new fingerprint → last-alert-time map.

    A finding alerted less than `realert_after_s` ago stays quiet, also when it cleared and
    came back (flapping). A persisting finding is re-alerted once per `realert_after_s`.
    A new cause on the same worker and GPU alerts at once and replaces the old cause, so a
    change back alerts too. Entries older than `realert_after_s` are dropped.
    """
    updated = {fp: ts for fp, ts in last_alerted.items() if now - ts < realert_after_s}
    new: list[Finding] = []
    for finding in findings:
        fp = finding.fingerprint()
        if fp in updated:
            continue
        subject = fp.rsplit("|", 1)[0]
        for other in [k for k in updated if k.rsplit("|", 1)[0] == subject]:
            del updated[other]
        updated[fp] = now
        new.append(finding)
    return new, updated
