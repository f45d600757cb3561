"""What a worker knows about its engine: its own limiter joined with the engine's reports.

`EngineState` is the one shape of "engine state": the worker runtime builds it from the
supervisor's lifecycle and /server_info (`EngineState.observe`), the telemetry loop adds the
engine's `/metrics`, the window and Prometheus keep it, diagnosis reads its JSON. The two
readers turn SGLang's Prometheus text and `/server_info` into its fields (only those they
found); `accept_length_from_server_info` is the one reader of the engine's accept length.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass, field, fields
from typing import Any


@dataclass(kw_only=True)
class EngineState:
    """The engine as one worker sees it: its own limiter plus what the engine reports.

    `inflight`/`inflight_cap` are the client's requests in flight and its limiter size
    (`max_inflight`); `running`/`queued` are inside the engine. Build it from the readers:
    `EngineState(up=True, inflight=3, inflight_cap=64, **{**from_info, **from_metrics})`
    (the metrics' per-interval accept length wins over the server_info lifetime mean).
    """

    up: bool
    restarting: bool = False
    restarts: int = 0  # engine restarts since the worker started (the supervisor's budget use)
    inflight: int = 0
    inflight_cap: int = 0
    max_running_requests: int | None = None  # the cap the engine enforces (`enforced_cap`)
    configured_max_running_requests: int | None = None  # the cap it was started with
    cap_limit: str | None = None  # what sets the enforced cap: see `cap_limit`
    # The engine plan of the worker's runtime for this card: the running-request cap it
    # expects, the flags that would reach it (a short text), and whether it chose MTP off.
    plan_cap: int | None = None
    plan_fix: str | None = None
    mtp_planned_off: bool = False
    running: int | None = None
    queued: int | None = None
    speculative_algorithm: str | None = None
    speculative_adaptive: bool = False  # SGLang's --speculative-adaptive: drafts shrink with load
    accept_length: float | None = None
    engine_tokens_per_s: float | None = None
    active_batches: int = 0
    waiting: int = 0  # prompts of this worker's batches not yet sent (the limiter is full)
    runs: list[str] = field(default_factory=list)
    spec_reported: bool = True  # False: the engine has no /server_info to say if MTP is on
    # The restart budget (a rate) and how the engine last died (`engine.crashes`):
    exhausted: bool = False  # budget spent: not taking work until its cool-down ends
    cooldown_left_s: float | None = None
    restarts_in_window: int = 0
    restart_budget: int | None = None
    restart_window_s: float | None = None
    crash: dict[str, Any] | None = None  # error, repeats, loop, known, what, workaround

    @classmethod
    def observe(
        cls,
        lifecycle: str,
        server_info: Mapping[str, Any],
        *,
        inflight: int = 0,
        inflight_cap: int = 0,
        restarts: int = 0,
        waiting: int = 0,
        budget: Mapping[str, Any] | None = None,
        crash: Mapping[str, Any] | None = None,
        plan_cap: int | None = None,
        plan_fix: str | None = None,
        mtp_planned_off: bool = False,
    ) -> EngineState:
        """The state of an engine in `lifecycle` (the supervisor's `state`: stopped, starting,
        ready, restarting, exhausted) whose last /server_info was `server_info`, with the
        client's limiter, its restart `budget` (`EngineSupervisor.budget()`) and `crash`
        report, and what the engine plan expects of this card (`plan_cap`, `plan_fix`,
        `mtp_planned_off`: the diagnosis judges the engine against them); no HTTP, so it is
        cheap to read every second."""
        figures = budget or {}
        return cls(
            up=lifecycle == "ready",
            restarting=lifecycle == "restarting",
            restarts=restarts,
            exhausted=lifecycle == "exhausted",
            cooldown_left_s=figures.get("cooldown_left_s"),
            restarts_in_window=int(figures.get("restarts_in_window") or 0),
            restart_budget=figures.get("restart_budget"),
            restart_window_s=figures.get("restart_window_s"),
            crash=dict(crash) if crash else None,
            inflight=inflight,
            inflight_cap=inflight_cap,
            waiting=waiting,
            plan_cap=plan_cap,
            plan_fix=plan_fix,
            mtp_planned_off=mtp_planned_off,
            spec_reported=bool(server_info),
            **engine_state_from_server_info(server_info),
        )

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> EngineState:
        names = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in data.items() if k in names})


_METRIC_KEYS = {
    "sglang:num_running_reqs": "running",
    "sglang:num_queue_reqs": "queued",
    "sglang:spec_accept_length": "accept_length",
    "sglang:gen_throughput": "engine_tokens_per_s",
}


def engine_state_from_metrics(text: str) -> dict[str, Any]:
    """EngineState fields from SGLang's Prometheus text (`/metrics`, `--enable-metrics`).

    Only the keys found are returned, so the result can override server_info readings.
    Scheduler gauges are read on tp_rank 0 and summed over DP ranks (accept length averaged);
    an accept length of 0 means "spec off or not measured yet" and is left out.
    """
    from prometheus_client.parser import text_string_to_metric_families

    values: dict[str, list[float]] = {}
    try:
        for family in text_string_to_metric_families(text):
            for s in family.samples:
                key = _METRIC_KEYS.get(s.name)
                if (
                    key
                    and s.labels.get("tp_rank", "0") == "0"
                    and s.labels.get("pp_rank", "0") == "0"
                ):
                    values.setdefault(key, []).append(float(s.value))
    except ValueError:
        return {}
    out: dict[str, Any] = {}
    for key in ("running", "queued"):
        if key in values:
            out[key] = int(sum(values[key]))
    if "engine_tokens_per_s" in values:
        out["engine_tokens_per_s"] = sum(values["engine_tokens_per_s"])
    accepts = [v for v in values.get("accept_length", []) if v > 0]
    if accepts:
        out["accept_length"] = sum(accepts) / len(accepts)
    return out


def _positive_int(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else None


def _first_state(info: Mapping[str, Any]) -> Mapping[str, Any]:
    """`internal_states[0]` of a `/server_info` (the scheduler of DP rank 0), {} when absent."""
    states = info.get("internal_states")
    if isinstance(states, list) and states and isinstance(states[0], Mapping):
        return states[0]
    return {}


def _dp_size(info: Mapping[str, Any]) -> int:
    return _positive_int(info.get("dp_size")) or 1


def enforced_cap(info: Mapping[str, Any]) -> int | None:
    """The running-request cap the engine enforces, from its `/server_info`.

    SGLang may enforce less than the configured `max_running_requests` (KV capacity, the
    mamba state pool of Qwen3.5-style models); the figure it schedules by is
    `internal_states[i].effective_max_running_requests_per_dp` × `dp_size`. Without it, the
    configured top-level value; None when neither is there (not SGLang).

        enforced_cap({"max_running_requests": 256, "dp_size": 2,
                      "internal_states": [{"effective_max_running_requests_per_dp": 40}] * 2})
        # 80
    """
    per_dp = _positive_int(_first_state(info).get("effective_max_running_requests_per_dp"))
    if per_dp is not None:
        return per_dp * _dp_size(info)
    return _positive_int(info.get("max_running_requests"))


def is_hybrid(info: Mapping[str, Any]) -> bool:
    """Whether the engine serves a hybrid model (linear attention with a recurrent state per
    request, as Qwen3.5/3.6): SGLang sizes a mamba state pool for it and reports its size as
    `max_mamba_cache_size` in `internal_states[0]` (the scheduler's own args; the top-level
    copy holds only what was passed, null by default), None for other models."""
    return any(
        _positive_int(where.get("max_mamba_cache_size")) is not None
        for where in (_first_state(info), info)
    )


def cap_limit(info: Mapping[str, Any]) -> str | None:
    """What sets the running-request cap the engine enforces, from its `/server_info`:

    - "configured": the enforced cap is the configured `max_running_requests` (top level);
    - "state_pool": it is lower, and the model is hybrid: the recurrent-state (mamba) pool
      holds that many requests' states;
    - "kv": it is lower (or SGLang chose it, none being configured) on a model without one:
      the KV cache holds that many requests' tokens.

    None when the engine reports no cap. With data parallelism the configured cap is split
    over the ranks (`configured // dp_size` each), so a remainder is no cut.

        cap_limit({"max_running_requests": 256,
                   "internal_states": [{"effective_max_running_requests_per_dp": 12,
                                        "max_mamba_cache_size": 7299}]})  # "state_pool"
    """
    enforced = enforced_cap(info)
    if enforced is None:
        return None
    configured = _positive_int(info.get("max_running_requests"))
    dp = _dp_size(info)
    if configured is not None and enforced // dp >= configured // dp:
        return "configured"
    return "state_pool" if is_hybrid(info) else "kv"


def engine_state_from_server_info(info: Mapping[str, Any]) -> dict[str, Any]:
    """EngineState fields from SGLang's `/server_info` (read after warm-up, and now and then).

    `speculative_algorithm` is always returned (None means spec is off); `max_running_requests`
    is the cap the engine enforces (`enforced_cap`), which may be below the configured one
    (`configured_max_running_requests`, the top-level figure), and `cap_limit` says what
    set it; `accept_length` is `internal_states[0].avg_spec_accept_length`, present only once
    decoding under spec happened.
    """
    out: dict[str, Any] = {"speculative_algorithm": info.get("speculative_algorithm") or None}
    if info.get("speculative_adaptive"):
        out["speculative_adaptive"] = True
    cap = enforced_cap(info)
    if cap is not None:
        out["max_running_requests"] = cap
        out["cap_limit"] = cap_limit(info)
    configured = _positive_int(info.get("max_running_requests"))
    if configured is not None:
        out["configured_max_running_requests"] = configured
    accept = accept_length_from_server_info(info)
    if accept is not None:
        out["accept_length"] = accept
    return out


def accept_length_from_server_info(info: Mapping[str, Any]) -> float | None:
    """`internal_states[0].avg_spec_accept_length` from `/server_info`: the mean accepted
    tokens per verify step since the engine started. None until decoding under speculative
    decoding happened (SGLang reports 0 or nothing before), and when spec is off."""
    states = info.get("internal_states")
    if not isinstance(states, list) or not states or not isinstance(states[0], Mapping):
        return None
    accept = states[0].get("avg_spec_accept_length")
    if isinstance(accept, int | float) and not isinstance(accept, bool) and accept > 0:
        return float(accept)
    return None


# SGLang's default adaptive tiers (`adaptive_spec_params.DEFAULT_ADAPTIVE_CONFIG`) always draft
# below 8 running requests (steps 1, 3, 7); from 8 they may stop drafting (step 0), and from 64
# they never draft, so the accept length there falls to 1.0 by design.
ADAPTIVE_ALWAYS_DRAFTS_BELOW = 8


def accept_length_judges_mtp(adaptive: bool, running: int | None) -> bool:
    """Whether a low accept length means broken MTP (missing draft weights).

    Fixed MTP: always. Adaptive: only with fewer than 8 requests running, where SGLang still
    drafts every step; at larger batches it may turn drafting off and 1.0 is what it chose.
    """
    if not adaptive:
        return True
    return running is not None and running < ADAPTIVE_ALWAYS_DRAFTS_BELOW
