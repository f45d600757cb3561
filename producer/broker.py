"""The producer's side of Celery: a client app that sends work orders by task name.

The producer never imports `workers`: it names the task (`genfleet.generate_batch`) and sends
JSON, so a producer-only install needs neither SGLang nor NVML.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterable
from typing import Any

import redis
from celery import Celery
from kombu.exceptions import OperationalError

from genfleet.common import keys
from genfleet.common.celery_config import GENERATE_TASK, celery_config
from genfleet.common.ledger import Ledger, work_order_of
from genfleet.common.records import WorkOrder
from genfleet.common.routing import ModelRef, work_queue
from genfleet.common.settings import Settings


def make_client_app(settings: Settings) -> Celery:
    app = Celery("genfleet-producer")
    app.conf.update(celery_config(settings))
    return app


def send_orders(app: Celery, settings: Settings, orders: Iterable[WorkOrder]) -> int:
    """Send work orders, each to its model's queue, over one connection; returns how many."""
    sent = 0
    with app.producer_or_acquire() as producer:
        for order in orders:
            body: dict[str, Any] = order.model_dump()
            app.send_task(
                GENERATE_TASK,
                kwargs={"order": body},
                queue=work_queue(settings.queue, ModelRef(order.engine, order.model)),
                task_id=f"{order.run}.{order.batch}.{uuid.uuid4().hex[:8]}",
                producer=producer,
            )
            sent += 1
    return sent


# How long `worker_queues` waits for workers' replies: a broadcast always waits this long.
INSPECT_TIMEOUT_S = 1.0


def worker_queues(app: Celery, timeout_s: float = INSPECT_TIMEOUT_S) -> dict[str, list[str]] | None:
    """The queues each live Celery worker consumes now, by worker: {} when none answers within
    `timeout_s`, None when the broker could not be asked.

    Asked after an enqueue and while a run waits, so that a run whose queue no worker consumes
    (enqueued for another model than the fleet serves) is told at once, not left queued.
    A worker answers only once it consumes: one still loading its engine is not listed.
    """
    try:
        replies = app.control.inspect(timeout=timeout_s).active_queues() or {}
    except (OSError, OperationalError, redis.RedisError):
        return None
    return {
        str(worker): sorted(str(queue["name"]) for queue in queues or [] if "name" in queue)
        for worker, queues in replies.items()
    }


def orders_in_broker(client: redis.Redis, queue: str, run: str) -> set[str]:
    """Batches of `run` that really have a work order in Redis: waiting in the queue,
    delivered but not acknowledged, or running on a worker.

    `--resume` and `retry` use this instead of the run's `queued` set, which a purged queue
    or a lost message would leave claiming orders that no longer exist.
    """
    found: set[str] = set()
    for name in keys.broker_queue_keys(queue):
        for raw in client.lrange(name, 0, -1):
            hit = work_order_of(raw)
            if hit and hit[0] == run:
                found.add(hit[1])
    ledger = Ledger(client)
    found.update(order.batch for order in ledger.unacked_orders() if order.run == run)
    return found | ledger.running_batches(run)


def purge_orders(client: redis.Redis, queue: str, run: str, unacked: bool = False) -> set[str]:
    """Remove `run`'s work orders waiting in `queue` (and, with `unacked`, those delivered but
    not acknowledged, which kombu would otherwise restore); returns their batches.

    `cancel` removes waiting orders so that no batch of the run starts again; a worker still
    holding one finds the run cancelled and parks it. `delete` also drops unacknowledged ones.
    """
    removed: set[str] = set()
    for name in keys.broker_queue_keys(queue):
        for raw in client.lrange(name, 0, -1):
            hit = work_order_of(raw)
            if hit and hit[0] == run and client.lrem(name, 0, raw):  # type: ignore[arg-type]
                removed.add(hit[1])
    if unacked:
        removed |= Ledger(client).purge_unacked(run)
    return removed
