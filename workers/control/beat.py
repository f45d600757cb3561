"""The control worker's beat tasks: what `genfleet control` runs, a few times a minute.

- reap_leases: the reaper (`workers.control.reaper`): batches of gone workers and lost orders
  sent again, poison parked;
- reconcile_progress: every running run's progress copy in Redis repaired from its outputs in
  the store (`workers.control.progress_repair`);
- power_watch: see `workers.observe.power_watch`.

The control side sends work orders by task name, as the producer does: it never imports the
generate task or the feeding path.
"""

from __future__ import annotations

import logging
import time
from typing import Any

from genfleet.common.celery_config import (
    GENERATE_TASK,
    POWER_WATCH_TASK,
    REAPER_TASK,
    RECONCILE_TASK,
)
from genfleet.common.redis_conn import connect
from genfleet.common.routing import order_queue
from genfleet.common.store import store_of
from genfleet.workers.app import app, settings_of
from genfleet.workers.context import BeatTask
from genfleet.workers.control import progress_repair, reaper
from genfleet.workers.process.reconnect import HeldRequest

log = logging.getLogger("genfleet.tasks")


@app.task(name=REAPER_TASK, base=BeatTask, Request=HeldRequest)  # type: ignore[untyped-decorator]
def reap_leases() -> dict[str, Any]:
    """Re-enqueue running batches whose worker is gone (its lease expired, or its connection
    with Redis, workers/observe/liveness.py) and whose output does not exist; give back the
    orders a dead worker received and never claimed; park those whose worker died
    `max_deliveries` times."""
    settings = settings_of(app)

    def send(order: dict[str, Any]) -> None:
        app.send_task(
            GENERATE_TASK, kwargs={"order": order}, queue=order_queue(settings.queue, order)
        )

    return reaper.one_pass(
        connect(settings),
        store_of(settings),
        settings.lease_ttl_s,
        settings.max_deliveries,
        send,
        lambda order: order_queue(settings.queue, order),
    )


@app.task(name=POWER_WATCH_TASK, base=BeatTask, Request=HeldRequest)  # type: ignore[untyped-decorator]
def power_watch() -> dict[str, Any]:
    from genfleet.workers.observe.power_watch import run_power_watch

    return run_power_watch(app, settings_of(app))


@app.task(name=RECONCILE_TASK, base=BeatTask, Request=HeldRequest)  # type: ignore[untyped-decorator]
def reconcile_progress() -> dict[str, Any]:
    """Repair every running run's progress copy in Redis from its outputs in the store."""
    settings = settings_of(app)
    now = time.time()
    done = progress_repair.reconcile_runs(store_of(settings), connect(settings), now)
    for repair in done.repairs:
        log.warning("progress of %s repaired from the store: %s", repair.run, repair.to_json())
    return {
        "ts": now,
        "repaired": [repair.to_json() for repair in done.repairs],
        "retired": done.retired,
        "failed": done.failed,
    }
