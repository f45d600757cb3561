"""This worker's engine: which one its settings name, made, started and watched.

The runtime holds the engine this returns and hands it to the feeder; everything that decides
how it is launched (preflight, port, argv, its API key, its log) happens here, once, when the
worker starts, so the runtime deals in one handle whatever the kind.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from genfleet.common.errors import ConfigError
from genfleet.common.settings import Settings
from genfleet.workers.engine.external import ExternalEngine
from genfleet.workers.engine.launch import auth_headers
from genfleet.workers.engine.plan import EnginePlan
from genfleet.workers.engine.ports import pick_port, private_dir
from genfleet.workers.engine.start_watch import group_cpu_s
from genfleet.workers.engine.supervisor import EngineSupervisor
from genfleet.workers.engine.watchdog import StallWatchdog, WatchedEngine

log = logging.getLogger("genfleet.worker")

Engine = EngineSupervisor | ExternalEngine


@dataclass(frozen=True)
class Hooks:
    """What the supervisor calls back (on its own thread): after each death, when the
    restart budget is spent, when the engine serves again after a cool-down, when it serves
    again after any restart."""

    on_death: Callable[[], None]
    on_exhausted: Callable[[str], None]
    on_recovered: Callable[[], None]
    on_restarted: Callable[[], None] = lambda: None


@dataclass(frozen=True)
class Made:
    """An engine not started yet, the settings it was made with (an API key of its own for
    an engine launched here, the engine plan's MTP choice), the checkpoint's
    `architectures[0]` when preflight read it, and the engine plan (None: no plan applies).
    For an external engine, `reference` is the plan genfleet would have launched it with:
    not what runs, what the power-watch judges it against."""

    engine: Engine
    settings: Settings
    arch: str | None
    plan: EnginePlan | None = None
    reference: EnginePlan | None = None


def make(settings: Settings, hostname: str, hooks: Hooks) -> Made:
    """The engine `settings.engine_kind` names, unstarted: an external one is reached at its
    URL, the others are launched on loopback under a supervisor."""
    from genfleet.workers.engine.kinds import with_engine_key

    settings = with_engine_key(settings)
    if settings.engine_kind == "emulator":
        log.warning(
            "ENGINE: the genfleet emulator (no model given): a dry run, outputs are synthetic"
        )
    if settings.engine_kind == "external":
        assert settings.engine_url is not None
        external = ExternalEngine(
            settings.engine_url, settings.engine_health_path, api_key(settings)
        )
        reference = reference_plan(settings)
        if reference is not None:
            log.info(
                "external engine judged against the engine plan for this card: cap %d (%s)",
                reference.max_running_requests,
                reference.fix,
            )
        return Made(external, settings, None, reference=reference)
    return _supervised(settings, hostname, hooks)


def reference_plan(settings: Settings) -> EnginePlan | None:
    """For an external engine: the plan genfleet would launch SGLang with for this checkpoint
    on this worker's card, so the power-watch can tell a GPU at its plan's cap from one below
    it. None where no plan applies or the model cannot be read."""
    from genfleet.workers.engine.kinds import planned
    from genfleet.workers.engine.preflight import checkpoint_arch

    as_sglang = settings.model_copy(update={"engine": "sglang"})
    try:
        _, plan = planned(as_sglang, checkpoint_arch(settings.model))
    except ConfigError:
        return None
    return plan if plan is not None and plan.planned else None


def start(engine: Engine, settings: Settings) -> dict[str, Any]:
    """Start `engine` and wait until it serves; its /server_info (or {})."""
    if isinstance(engine, ExternalEngine):
        return engine.start(timeout_s=min(settings.startup_timeout_s, 120.0))
    return engine.start()


def api_key(settings: Settings) -> str | None:
    return settings.engine_api_key.get_secret_value() if settings.engine_api_key else None


def _supervised(settings: Settings, hostname: str, hooks: Hooks) -> Made:
    from genfleet.workers.engine.kinds import engine_launch, planned
    from genfleet.workers.engine.preflight import preflight

    arch = preflight(settings).arch if settings.engine_kind == "sglang" else None
    settings, plan = planned(settings, arch)
    if plan is not None:
        log.info("engine plan:\n%s", plan.describe())
    port = pick_port(settings.engine_host, settings.port)
    launch = engine_launch(settings, port, arch=arch, plan=plan)
    assert launch is not None
    log_dir = Path(settings.log_dir) if settings.log_dir else private_dir("logs")
    safe_host = hostname.replace("@", "_").replace("/", "_")
    supervisor = EngineSupervisor(
        launch,
        gpus=settings.gpus,
        log_path=log_dir / f"engine-{safe_host}-{port}.log",
        startup_timeout_s=settings.startup_timeout_s,
        stop_timeout_s=settings.stop_timeout_s,
        restart_budget=settings.restart_budget,
        restart_backoff_s=settings.restart_backoff_s,
        on_exhausted=hooks.on_exhausted,
        restart_window_s=settings.restart_window_s,
        restart_cooldown_s=settings.restart_cooldown_s,
        on_recovered=hooks.on_recovered,
        on_death=hooks.on_death,
        start_stall_s=settings.engine_stall_timeout_s,
        on_restarted=hooks.on_restarted,
    )
    return Made(supervisor, settings, arch, plan)


def watchdog(
    settings: Settings,
    engine: Engine,
    inflight: Callable[[], int],
    completions: Callable[[], int],
    on_stall: Callable[[dict[str, Any]], None],
) -> StallWatchdog | None:
    """A started stall watchdog over `engine` (None when `engine_stall_timeout_s` is 0):
    `inflight` and `completions` are the client's view (requests in flight, tokens
    received)."""
    if not settings.engine_stall_timeout_s:
        return None
    health = settings.engine_health_path
    if settings.engine_kind in ("sglang", "emulator"):
        health = "/health_generate"  # SGLang generates one token for it
    watched = WatchedEngine(
        base_url=engine.base_url,
        health_path=health,
        headers=auth_headers(api_key(settings)),
        inflight=inflight,
        completions=completions,
        ready=lambda: engine.state == "ready",
        incarnation=lambda: engine.restarts,
        cpu_s=lambda: _group_cpu_s(engine),
    )
    dog = StallWatchdog(watched, settings.engine_stall_timeout_s, on_stall)
    dog.start()
    return dog


def _group_cpu_s(engine: Engine) -> float | None:
    """The CPU seconds of the engine's process group (its own session: the supervisor starts
    it so); None for an engine genfleet did not start, or one not running."""
    if isinstance(engine, ExternalEngine) or engine.pid is None:
        return None
    return group_cpu_s(engine.pid)
