"""Celery tasks: thin wrappers that validate a message, call one core function, map errors.

- generate_batch: a WorkOrder → workers.batch.execute. Retryable failures (engine down, store
  or Redis unreachable) are retried with backoff; after `batch_retries` tries, or at once for
  permanent ones (staged input missing, anything unforeseen), the batch lands in the run's
  failed set. An order for another model is handed back to its own queue, never generated;
  an order of a cancelled run is parked (acknowledged, not generated; a resume sends it
  again), and one of a deleted run is dropped.
  An engine that refuses the worker itself (401/403/404: key, URL, model name) is no
  batch's fault: the order goes back to the queue untouched and this worker stops
  consuming, saying why.
- reap_leases (beat): re-enqueues batches whose worker vanished (lease expired, no output),
  so a SIGKILLed worker's batch finishes elsewhere in minutes, not after the visibility timeout.
- power_watch (beat): see genfleet.workers.observe.power_watch.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

import orjson
import redis
from celery import Task
from celery.exceptions import Reject

from genfleet.common import keys
from genfleet.common.celery_config import GENERATE_TASK, POWER_WATCH_TASK, REAPER_TASK, order_queue
from genfleet.common.errors import EngineConfigError, EngineError, StoreError
from genfleet.common.records import WorkOrder
from genfleet.common.redis_conn import RedisCommands, text
from genfleet.common.store import Store
from genfleet.workers.app import app, settings_of
from genfleet.workers.batch import BatchCancelled, BatchInputMissing, BatchInterrupted, execute
from genfleet.workers.lifecycle import gate, is_cancelled, park
from genfleet.workers.observe.headlines import batch_headline, not_generated_headline
from genfleet.workers.runtime import current

log = logging.getLogger("genfleet.tasks")

RETRYABLE = (EngineError, StoreError, redis.RedisError, ConnectionError, TimeoutError)


class BatchFailed(Exception):
    """A batch that exhausted its tries or cannot succeed; it is in the run's failed set."""


def running_field(run: str, batch: str) -> str:
    return f"{run}/{batch}"


@app.task(name=GENERATE_TASK, bind=True)  # type: ignore[untyped-decorator]
def generate_batch(self: Task, order: dict[str, Any]) -> dict[str, Any]:
    work = WorkOrder.model_validate(order)
    runtime = current()
    settings = runtime.settings
    client = runtime.redis
    assert runtime.feeder is not None
    turned_away = gate(client, work, runtime.queue, order_queue(settings.queue, order))
    if turned_away is not None:
        if turned_away.get("handed_back"):
            generate_batch.apply_async(kwargs={"order": order}, queue=turned_away["queue"])
        return {"summary": not_generated_headline(turned_away), **turned_away}
    field = running_field(work.run, work.batch)
    client.hset(keys.running_key(), field, orjson.dumps({**order, "claimed_at": time.time()}))
    monitor = runtime.monitor
    if monitor is not None:
        monitor.batch_started(work.run)
    try:
        summary = execute(
            work,
            store=runtime.store,
            client=client,
            feeder=runtime.feeder,
            worker=self.request.hostname or runtime.hostname,
            lease_ttl_s=settings.lease_ttl_s,
            checkpoint_interval_s=settings.checkpoint_interval_s,
            gpus=settings.gpus,
            cancelled=lambda: is_cancelled(client, work.run),
        )
    except BatchCancelled as exc:
        log.warning("%s", exc)
        park(client, work)
        _safe_hdel(client, field)
        parked = {"run": work.run, "batch": work.batch, "cancelled": True}
        return {"summary": not_generated_headline(parked), **parked}
    except BatchInputMissing as exc:
        _fail(client, work, exc)
        raise BatchFailed(str(exc)) from exc
    except EngineConfigError as exc:
        # Every prompt would get the same answer: spend no try, hand the order back for a
        # worker that is configured right, and stop this one taking more.
        _safe_hdel(client, field)
        runtime.refuse_work(f"{work.run}/{work.batch} handed back: {exc}")
        raise Reject(str(exc), requeue=True) from exc
    except BatchInterrupted as exc:
        # Shutting down: put the message back for another worker (or this one, restarted);
        # the retry skips the prompts the checkpoint holds. Not a try, not a failure.
        log.warning("%s", exc)
        _safe_hdel(client, field)
        raise Reject(str(exc), requeue=True) from exc
    except RETRYABLE as exc:
        attempts = _attempt(client, work)
        if attempts > settings.batch_retries:
            _fail(client, work, exc)
            raise BatchFailed(f"{work.run}/{work.batch} failed {attempts} times: {exc}") from exc
        log.warning("%s/%s try %d failed: %s", work.run, work.batch, attempts, exc)
        _safe_hdel(client, field)
        raise self.retry(
            exc=exc, countdown=min(2**attempts, 60), max_retries=None, queue=runtime.queue
        ) from exc
    except Exception as exc:
        # Unforeseen means permanent until someone looks: park it in the failed set, where
        # status shows it and `genfleet retry` re-runs it, rather than leave a running entry
        # whose lease is gone, which the reaper would re-enqueue forever.
        log.exception("%s/%s failed unexpectedly", work.run, work.batch)
        _fail(client, work, exc)
        raise BatchFailed(f"{work.run}/{work.batch}: {type(exc).__name__}: {exc}") from exc
    finally:
        if monitor is not None:
            monitor.batch_finished(work.run)
    _safe_hdel(client, field)
    runtime.after_batch(summary)
    figures = summary.to_json()
    # The line first: Flower shows it; every figure stays in the result after it.
    return {"summary": batch_headline(figures), **figures}


def _attempt(client: RedisCommands, work: WorkOrder) -> int:
    try:
        return int(client.hincrby(keys.attempts_key(work.run), work.batch, 1))
    except redis.RedisError:
        return 1


def _fail(client: RedisCommands, work: WorkOrder, exc: BaseException) -> None:
    """Park the batch in the failed set with its last error; `genfleet retry` re-enqueues."""
    try:
        pipe = client.pipeline()
        pipe.hset(keys.failed_key(work.run), work.batch, f"{type(exc).__name__}: {exc}"[:2000])
        pipe.srem(keys.queued_key(work.run), work.batch)
        pipe.hdel(keys.running_key(), running_field(work.run, work.batch))
        pipe.execute()
    except redis.RedisError:
        log.exception("could not record failed batch %s/%s", work.run, work.batch)


def _safe_hdel(client: RedisCommands, field: str) -> None:
    try:
        client.hdel(keys.running_key(), field)
    except redis.RedisError:
        log.warning("could not clear running entry %s", field)


@app.task(name=REAPER_TASK)  # type: ignore[untyped-decorator]
def reap_leases() -> dict[str, Any]:
    """Re-enqueue running batches whose lease expired and whose output does not exist."""
    from genfleet.common.redis_conn import connect
    from genfleet.common.store import open_store

    settings = settings_of(app)
    return reap(
        connect(settings),
        open_store(settings.store, settings.s3_endpoint_url, settings.s3_region),
        settings.lease_ttl_s,
        time.time(),
        lambda order: generate_batch.apply_async(
            kwargs={"order": order}, queue=order_queue(settings.queue, order)
        ),
    )


def reap(
    client: RedisCommands,
    store: Store,
    lease_ttl_s: float,
    now: float,
    requeue: Callable[[dict[str, Any]], object],
) -> dict[str, Any]:
    """One reaper pass over the running batches: a batch whose lease expired is finished when
    its output exists (its entry is dropped), else `requeue`d with its work order, once."""
    requeued: list[str] = []
    finished: list[str] = []
    for field, raw in client.hgetall(keys.running_key()).items():
        entry = orjson.loads(raw)
        run, batch = entry["run"], entry["batch"]
        if client.exists(keys.lease_key(run, batch)):
            continue
        if now - float(entry.get("claimed_at", 0)) < lease_ttl_s:
            continue  # claimed but the first lease write may not have landed yet
        if store.exists(keys.output_key(run, batch)):
            client.hdel(keys.running_key(), field)
            finished.append(text(field))
            continue
        order = {k: v for k, v in entry.items() if k != "claimed_at"}
        if client.exists(keys.cancelled_key(run), keys.deleted_key(run)):
            park(client, WorkOrder.model_validate(order))  # nothing to redo: parked
            continue
        if client.hdel(keys.running_key(), field):  # only one reaper wins the re-enqueue
            requeue(order)
            requeued.append(text(field))
            log.warning("lease of %s expired without output: re-enqueued", text(field))
    return {"requeued": requeued, "finished": finished, "ts": now}


@app.task(name=POWER_WATCH_TASK)  # type: ignore[untyped-decorator]
def power_watch() -> dict[str, Any]:
    from genfleet.workers.observe.power_watch import run_power_watch

    return run_power_watch(app, settings_of(app))
