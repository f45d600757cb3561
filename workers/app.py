"""The Celery app of every genfleet process: `celery -A genfleet.workers.app …`.

The process's `Settings` are handed to the app by `configure()` at its edge (`genfleet worker`,
`control`, `top`) before Celery first needs its configuration; a process started by the
`celery` program itself (Flower, `celery inspect`) builds them once from its environment then.
Either way they sit in `app.conf` (`settings_of(app)`), where the engine step and the tasks
read them. Nothing is read at import.

The engine is started by a worker-level bootstep: before the worker consumes, after its pool
exists; stopped when the worker shuts down. (Consumer steps would restart the engine on every
broker reconnect, so this must be a worker step.) What it builds, the worker's runtime, it
attaches to the worker (`genfleet_runtime`, read by `gpu_report`) and to the generate task's
base class (`BatchTask.runtime`, read by the task and the pool).
"""

from __future__ import annotations

import logging
import time
from typing import Any

from celery import Celery, bootsteps
from celery.signals import worker_ready
from celery.worker.control import inspect_command

from genfleet.common.celery_config import (
    POWER_WATCH_TASK,
    REAPER_TASK,
    RECONCILE_TASK,
    celery_config,
)
from genfleet.common.errors import ConfigError
from genfleet.common.settings import Settings
from genfleet.workers.context import BatchTask
from genfleet.workers.process import heap

log = logging.getLogger("genfleet.worker")

app = Celery("genfleet", include=["genfleet.workers.tasks", "genfleet.workers.control.beat"])

SETTINGS_KEY = "genfleet_settings"
_given: list[Settings] = []  # what configure() handed over, read once when the conf loads
# Why this process's engine step could not start (preflight refused the checkpoint, the engine
# never became ready): Celery logs it and returns an exit code that `worker_main` drops, so
# `run_celery` reads it here to exit non-zero with the reason.
startup_failures: list[str] = []


def configure(settings: Settings) -> None:
    """Make `settings` this process's configuration; call before anything touches `app.conf`.

    Raises ConfigError when the configuration was already loaded: it would be ignored.
    """
    if app.configured:
        raise ConfigError("the Celery app was configured before its settings were handed over")
    _given[:] = [settings]


def settings_of(celery_app: Celery) -> Settings:
    """The Settings this worker process runs with (see `configure`)."""
    settings = celery_app.conf.get(SETTINGS_KEY)
    if not isinstance(settings, Settings):
        raise ConfigError(f"the Celery app {celery_app.main!r} carries no genfleet settings")
    return settings


def _defaults() -> dict[str, Any]:
    # No configure() call: a process started by the `celery` program; its edge is here.
    settings = _given[0] if _given else Settings()
    config = celery_config(settings)
    config[SETTINGS_KEY] = settings
    config["beat_schedule"] = {
        "power-watch": {
            "task": POWER_WATCH_TASK,
            "schedule": settings.power_watch_interval_s,
            # A beat tick that could not run in time is stale: never let them pile up.
            "options": {"expires": settings.power_watch_interval_s * 0.8, "queue": "control"},
        },
        "reap-leases": {
            "task": REAPER_TASK,
            "schedule": settings.reaper_interval_s,
            "options": {"expires": settings.reaper_interval_s * 0.8, "queue": "control"},
        },
        "reconcile-progress": {
            "task": RECONCILE_TASK,
            "schedule": settings.reconcile_interval_s,
            "options": {"expires": settings.reconcile_interval_s * 0.8, "queue": "control"},
        },
    }
    config["task_routes"][POWER_WATCH_TASK] = {"queue": "control"}
    config["task_routes"][REAPER_TASK] = {"queue": "control"}
    config["task_routes"][RECONCILE_TASK] = {"queue": "control"}
    return config


app.add_defaults(_defaults)


class EngineStep(bootsteps.StartStopStep):  # type: ignore[misc]
    """Starts the worker's engine before it consumes; stops it (and its group) at shutdown."""

    requires = ("celery.worker.components:Pool",)

    def __init__(self, parent: Any, **kwargs: Any) -> None:
        super().__init__(parent, **kwargs)
        self.runtime: Any = None
        self.pusher: Any = None

    def start(self, parent: Any) -> None:
        from genfleet.common.routing import worker_queue
        from genfleet.workers.runtime import WorkerRuntime

        settings = settings_of(parent.app)
        if settings.role == "control":
            return  # beat and power-watch only: no engine, no GPU
        hostname = parent.hostname

        queue = worker_queue(settings)

        def consume(on: bool) -> None:
            """Start or stop consuming `queue`; a broker that is gone only leaves it as it is
            (the next cool-down or restart tries again, the state says why)."""
            control = parent.app.control
            try:
                if on:
                    control.add_consumer(queue, destination=[hostname])
                else:
                    control.cancel_consumer(queue, destination=[hostname])
            except Exception:  # noqa: BLE001 - broker may be gone too
                log.exception("could not %s consuming from %s", "go on" if on else "stop", queue)

        def exhausted(message: str) -> None:
            log.error("%s: %s", hostname, message)
            consume(False)

        def recovered() -> None:
            log.warning("%s: engine back after its cool-down, consuming %s again", hostname, queue)
            consume(True)

        def pause(message: str) -> None:
            log.warning("%s: %s: taking no order from %s meanwhile", hostname, message, queue)
            consume(False)

        def resume() -> None:
            log.warning("%s: engine back, consuming %s again", hostname, queue)
            consume(True)

        runtime = None
        try:
            runtime = WorkerRuntime(
                settings,
                hostname,
                on_exhausted=exhausted,
                on_recovered=recovered,
                on_pause=pause,
                on_resume=resume,
            )
            runtime.celery_worker = parent
            self.runtime = runtime
            self.pusher = _pusher(settings, hostname, runtime.report)
            runtime.start()
        except Exception as exc:
            startup_failures.append(f"{type(exc).__name__}: {exc}")
            if runtime is not None:
                runtime.stop()
            if self.pusher is not None:
                self.pusher.stop()
                self.pusher = None
            raise
        parent.genfleet_runtime = runtime
        parent.genfleet_pusher = self.pusher
        BatchTask.runtime = runtime
        log.info("%s: start-up heap settled (%d objects frozen)", hostname, heap.settle())

    def stop(self, parent: Any) -> None:
        runtime = self.runtime
        if runtime is None:
            return
        if not _wait_for_running_tasks(runtime.settings.shutdown_grace_s) and runtime.feeder:
            cancelled = runtime.feeder.cancel_all()
            log.warning(
                "shutdown grace of %.0f s is over: %d running batches checkpointed and handed "
                "back to the queue",
                runtime.settings.shutdown_grace_s,
                cancelled,
            )
            _wait_for_running_tasks(15.0)
        BatchTask.runtime = None
        parent.genfleet_runtime = None
        parent.genfleet_pusher = None
        runtime.stop()
        self.runtime = None
        if self.pusher is not None:
            self.pusher.stop()  # withdrawn: a worker that stopped is not silent
            self.pusher = None

    def shutdown(self, parent: Any) -> None:
        self.stop(parent)

    def info(self, parent: Any) -> dict[str, Any]:
        """Merged into the worker's `stats` reply (`WorkController.stats`), which Flower's
        worker page shows under "Other": the engine's state in a line, its alarm first when
        its restart budget is spent or it crashes in a loop (task results cannot say that:
        a worker that takes no work has none)."""
        from genfleet.workers.observe.diagnosis import engine_headline

        runtime = self.runtime
        if runtime is None:
            return {}
        return {"genfleet_engine": engine_headline(runtime.engine_state().to_json())}


@worker_ready.connect  # type: ignore[untyped-decorator]
def _consuming(sender: Any = None, **_: Any) -> None:
    """The worker consumes its queue now (Celery sends worker_ready once its consumer has
    started, after the engine step): its summary stops saying it is starting, pushed at once
    rather than in a while."""
    worker = getattr(sender, "controller", None)
    runtime = getattr(worker, "genfleet_runtime", None)
    if runtime is None:
        return  # the control worker, or an engine that failed to start
    runtime.consuming = True
    pusher = getattr(worker, "genfleet_pusher", None)
    if pusher is not None:
        pusher.push_now()


def _wait_for_running_tasks(timeout_s: float, poll_s: float = 0.2) -> bool:
    """Wait until no task runs in this worker (True) or `timeout_s` passes (False).

    Called on warm shutdown, before the engine stops.

    Celery stops worker steps in reverse start order, so this step (which needs the pool) is
    stopped before the pool, whose own stop waits for running tasks. Stopping the engine
    first would break every batch still running under a warm shutdown (SIGTERM, `docker
    stop`). The consumer no longer takes messages by now; a cold shutdown (SIGQUIT) ends the
    wait, and the engine stops with the worker.
    """
    from celery.worker import state

    if state.active_requests:
        log.info(
            "waiting for %d running tasks before stopping the engine", len(state.active_requests)
        )
    deadline = time.monotonic() + timeout_s
    while state.active_requests and state.should_terminate is None:
        if time.monotonic() > deadline:
            return False
        time.sleep(poll_s)
    return not state.active_requests


app.steps["worker"].add(EngineStep)


def _pusher(settings: Settings, hostname: str, report: Any) -> Any:
    """The thread that pushes this worker's GPU summary for the power-watch, started before
    the engine (while it loads, the summary says so: its node's GPUs are not unclaimed)."""
    from genfleet.common.redis_conn import connect
    from genfleet.workers.observe.pushed import Pusher, push_interval_s

    client = connect(settings, check=False, timeout_s=5.0)
    interval_s = push_interval_s(
        settings.power_watch_interval_s, settings.power_window_s, settings.sample_interval_s
    )
    pusher = Pusher(client, hostname, report, interval_s)
    pusher.start()
    return pusher


@inspect_command()  # type: ignore[untyped-decorator]
def gpu_report(state: Any) -> dict[str, Any]:
    """This worker's recent GPU and engine window, for the power-watch and `genfleet top`."""
    worker = getattr(state.consumer, "controller", None)
    runtime = getattr(worker, "genfleet_runtime", None)
    if runtime is None:
        import socket

        return {"ok": False, "reason": "engine not started", "node": socket.gethostname()}
    report: dict[str, Any] = runtime.report()
    return report
