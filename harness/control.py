"""Celery's remote control of a test's workers: ping, inspect, the reports they answer."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

from harness.waits import wait_for


@contextlib.contextmanager
def control_app(broker_url: str) -> Iterator[Any]:
    """A bare Celery app on `broker_url` for remote control (ping, inspect) of test workers."""
    from celery import Celery

    app = Celery("genfleet-test", broker=broker_url, set_as_current=False)
    app.conf.broker_connection_retry_on_startup = True
    try:
        yield app
    finally:
        app.close()


def answering(broker_url: str, hostnames: list[str], timeout_s: float = 0.5) -> set[str]:
    """Which of the Celery workers `hostnames` answer a ping on `broker_url` now.

    A genfleet worker answers only once it consumes, and it consumes only after its engine
    step started the engine and the engine served (the consumer is the last worker step), so
    an answer means ready.
    """
    with control_app(broker_url) as app:
        replies = app.control.ping(destination=hostnames, timeout=timeout_s)
    return {name for reply in replies for name in reply} & set(hostnames)


def running_batches(
    broker_url: str, hostnames: list[str], timeout_s: float = 1.0
) -> set[str] | None:
    """The batches ("run.batch") the Celery workers `hostnames` run now (their active
    generate tasks, whose ids are `run.batch.<suffix>`); None while one of them does not
    answer (what it runs is unknown, not none)."""
    with control_app(broker_url) as app:
        replies = app.control.inspect(destination=hostnames, timeout=timeout_s).active() or {}
    if set(replies) != set(hostnames):
        return None
    return {
        str(task.get("id", "")).rsplit(".", 1)[0] for tasks in replies.values() for task in tasks
    }


def worker_report(broker_url: str, hostname: str, timeout_s: float = 1.0) -> dict[str, Any]:
    """Worker `hostname`'s `gpu_report` inspect reply now (its telemetry window, its engine
    state, its recent findings); {} when it does not answer."""
    with control_app(broker_url) as app:
        inspect = app.control.inspect(destination=[hostname], timeout=timeout_s)
        replies = inspect._request("gpu_report") or {}
    report: dict[str, Any] = replies.get(hostname) or {}
    return report


def engine_report(broker_url: str, hostname: str, timeout_s: float = 1.0) -> dict[str, Any]:
    """The engine state (`EngineState` JSON) worker `hostname` reports now; {} when it does
    not answer or has no sample yet."""
    engine: dict[str, Any] = worker_report(broker_url, hostname, timeout_s).get("engine") or {}
    return engine


def wait_engine_up(broker_url: str, hostname: str, restarts: int, timeout_s: float = 60.0) -> None:
    """Wait until worker `hostname` reports its engine up after `restarts` restarts."""
    wait_for(
        lambda: (e := engine_report(broker_url, hostname)).get("up") and e["restarts"] == restarts,
        timeout_s,
        f"{hostname} to report its engine up after {restarts} restart(s)",
        0.2,
    )


def consuming(hostname: str) -> list[str] | None:
    """The queues `hostname` consumes from, or None while it does not answer."""
    from genfleet.workers.app import app as worker_app

    replies: dict[str, Any] = (
        worker_app.control.inspect([hostname], timeout=1.0).active_queues() or {}
    )
    queues = replies.get(hostname)
    return None if queues is None else [q["name"] for q in queues]
