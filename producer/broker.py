"""The producer's side of Celery: a client app that sends work orders by task name.

The producer never imports `workers`: it names the task (`genfleet.generate_batch`) and sends
JSON, so a producer-only install needs neither SGLang nor NVML.
"""

from __future__ import annotations

import hashlib
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
        removed |= purge_waiting(client, name, run)
    if unacked:
        removed |= Ledger(client).purge_unacked(run)
    return removed


# One pass over a queue list, atomic: survivors are copied, in order, to a new list that then
# replaces it; a message goes when the SHA-1 of its bytes is in the set of those to remove.
# Windows of LRANGE keep the script's memory bounded; it runs for O(queue) on Redis's thread
# once, where one LREM per message cost O(queue) each.
_FILTER = """
local total, removed, step = redis.call('LLEN', KEYS[1]), 0, 1000
for start = 0, total - 1, step do
  for _, value in ipairs(redis.call('LRANGE', KEYS[1], start, start + step - 1)) do
    if redis.call('SISMEMBER', KEYS[2], redis.sha1hex(value)) == 1 then
      removed = removed + 1
    else
      redis.call('RPUSH', KEYS[3], value)
    end
  end
end
if removed > 0 then
  if redis.call('EXISTS', KEYS[3]) == 1 then
    redis.call('RENAME', KEYS[3], KEYS[1])
  else
    redis.call('DEL', KEYS[1])
  end
end
redis.call('DEL', KEYS[2], KEYS[3])
return removed
"""

_WINDOW = 1000


def purge_waiting(client: redis.Redis, name: str, run: str) -> set[str]:
    """Remove `run`'s work orders from the queue list `name` in O(queue) once; returns their
    batches.

    The messages are told apart here, exactly (`work_order_of`), window by window; then one
    script drops those whose bytes match, by SHA-1, in a single atomic pass. A message a worker
    took in between is simply not found (the worker finds the run cancelled and parks it).
    """
    removed: set[str] = set()
    digests: list[str] = []
    start = 0
    while True:
        window = client.lrange(name, start, start + _WINDOW - 1)
        for raw in window:
            hit = work_order_of(raw)
            if hit and hit[0] == run:
                removed.add(hit[1])
                data = raw if isinstance(raw, bytes) else raw.encode()
                digests.append(hashlib.sha1(data).hexdigest())  # a match, not a secret
        if len(window) < _WINDOW:
            break
        start += _WINDOW
    if not digests:
        return set()
    tag = uuid.uuid4().hex
    doomed, rebuilt = f"{name}{keys.PRIORITY_SEP}purge-{tag}", f"{name}{keys.PRIORITY_SEP}new-{tag}"
    pipe = client.pipeline(transaction=False)
    for i in range(0, len(digests), _WINDOW):
        pipe.sadd(doomed, *digests[i : i + _WINDOW])
    pipe.expire(doomed, 3600)  # never left behind by a producer that died here
    pipe.execute()
    client.eval(_FILTER, 3, name, doomed, rebuilt)
    return removed
