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
  so a SIGKILLed worker's batch finishes elsewhere in minutes, not after the visibility timeout;
  a batch whose worker died `max_deliveries` times is parked in the failed set as poison (it
  would otherwise crash the fleet one worker at a time, forever). Then it sends again the
  orders that were lost (genfleet.workers.reconcile).
- power_watch (beat): see genfleet.workers.observe.power_watch.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any, NoReturn

import orjson
import redis
from celery import Task
from celery.exceptions import Reject, Retry
from kombu.exceptions import OperationalError

from genfleet.common import keys
from genfleet.common.celery_config import (
    GENERATE_TASK,
    POWER_WATCH_TASK,
    REAPER_TASK,
    work_order_of,
)
from genfleet.common.errors import EngineConfigError, EngineError, StoreError
from genfleet.common.records import WorkOrder
from genfleet.common.redis_conn import RedisCommands, text
from genfleet.common.routing import order_queue
from genfleet.common.store import Store
from genfleet.workers.app import app, settings_of
from genfleet.workers.batch import (
    BatchCancelled,
    BatchInputMissing,
    BatchInterrupted,
    execute,
)
from genfleet.workers.lifecycle import Lease, gate, is_cancelled, park
from genfleet.workers.observe.headlines import batch_headline, not_generated_headline
from genfleet.workers.observe.sampler import batch_share
from genfleet.workers.pool import BatchRequest
from genfleet.workers.reconcile import reconcile_orders
from genfleet.workers.runtime import current

log = logging.getLogger("genfleet.tasks")

RETRYABLE = (EngineError, StoreError, redis.RedisError, ConnectionError, TimeoutError)


class BatchFailed(Exception):
    """A batch that exhausted its tries or cannot succeed; it is in the run's failed set."""


def running_field(run: str, batch: str) -> str:
    return f"{run}/{batch}"


@app.task(name=GENERATE_TASK, bind=True, Request=BatchRequest)  # type: ignore[untyped-decorator]
def generate_batch(self: Task, order: dict[str, Any]) -> dict[str, Any]:
    work = WorkOrder.model_validate(order)
    runtime = current()
    settings = runtime.settings
    client = runtime.redis
    assert runtime.feeder is not None
    field = running_field(work.run, work.batch)
    worker = self.request.hostname or runtime.hostname
    early = _admit(runtime, work, order, worker)
    if early is not None:
        return early
    monitor = runtime.monitor
    if monitor is not None:
        monitor.batch_started(work.run)
    slot, spend = _Slot(runtime), _Spend(runtime)
    try:
        summary = execute(
            work,
            store=runtime.store,
            client=client,
            feeder=runtime.feeder,
            worker=worker,
            lease_ttl_s=settings.lease_ttl_s,
            checkpoint_interval_s=settings.checkpoint_interval_s,
            gpus=settings.gpus,
            cancelled=lambda: is_cancelled(client, work.run),
            lease_client=runtime.lease_redis,
            on_sent=slot.release,
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
        if (work.run, work.batch) in runtime.feeder.terminated:
            runtime.feeder.terminated.discard((work.run, work.batch))
            reason = BatchInterrupted(f"terminated by an operator (revoke): {exc}")
            _fail(client, work, reason)
            raise BatchFailed(str(reason)) from exc
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
        _back_off(runtime.lease_redis, work, worker, settings.lease_ttl_s, attempts)
        _safe_hdel(client, field)
        _retry_or_requeue(self, field, exc, countdown=0, queue=runtime.queue)
    except Exception as exc:
        # Unforeseen means permanent until someone looks: park it in the failed set, where
        # status shows it and `genfleet retry` re-runs it, rather than leave a running entry
        # whose lease is gone, which the reaper would re-enqueue forever.
        log.exception("%s/%s failed unexpectedly", work.run, work.batch)
        _fail(client, work, exc)
        raise BatchFailed(f"{work.run}/{work.batch}: {type(exc).__name__}: {exc}") from exc
    finally:
        slot.restore()
        if monitor is not None:
            monitor.batch_finished(work.run)
    _safe_hdel(client, field)
    spend.settle(summary, client, work)
    runtime.after_batch(summary)
    figures = summary.to_json()
    # The line first: Flower shows it; every figure stays in the result after it.
    return {"summary": batch_headline(figures), **figures}


def _admit(
    runtime: Any, work: WorkOrder, order: dict[str, Any], worker: str
) -> dict[str, Any] | None:
    """Claim the batch (its running entry), or say why it is not generated here (the task's
    result). A Redis failure here comes after the message was taken and before anything is
    recorded: the message goes back to the queue, never acked."""
    client, settings = runtime.redis, runtime.settings
    field = running_field(work.run, work.batch)
    try:
        turned_away = gate(client, work, runtime.queue, order_queue(settings.queue, order))
        if turned_away is not None:
            if turned_away.get("handed_back"):
                generate_batch.apply_async(kwargs={"order": order}, queue=turned_away["queue"])
            return {"summary": not_generated_headline(turned_away), **turned_away}
        if _parked(client, work, settings.max_deliveries):
            # A stale copy (the broker's redelivery after its visibility timeout) of a batch
            # parked as poison: running it would crash one more worker.
            log.error("%s/%s is parked as poison: not running it", work.run, work.batch)
            return {"run": work.run, "batch": work.batch, "worker": worker, "parked": True}
        entry = {**order, "claimed_at": time.time(), "worker": worker}
        client.hset(keys.running_key(), field, orjson.dumps(entry))
    except (redis.RedisError, OperationalError) as exc:
        # OperationalError: the hand-back could not be sent (the broker is down); acking this
        # message would lose the only copy of the order.
        raise Reject(
            f"{field}: Redis failed before the batch started: {exc}", requeue=True
        ) from exc
    return None


def _parked(client: RedisCommands, work: WorkOrder, max_deliveries: int) -> bool:
    return int(client.hget(keys.lost_key(work.run), work.batch) or 0) >= max_deliveries


class _Slot:
    """The batch's slot: released (from the feeder's loop) once every prompt is in the
    engine, so the worker takes its next batch; taken back when the batch ends."""

    def __init__(self, runtime: Any) -> None:
        self.runtime = runtime
        self.released = False

    def release(self) -> None:
        self.released = bool(self.runtime.release_slot())

    def restore(self) -> None:
        if self.released:
            self.runtime.restore_slot()


class _Spend:
    """The batch's GPU energy and time: readings when it starts, its share when it ends."""

    def __init__(self, runtime: Any) -> None:
        self.runtime = runtime
        self.energy = self._energy()
        self.tokens = runtime.feeder.tokens_total
        self.started = time.monotonic()

    def _energy(self) -> tuple[float | None, int]:
        monitor = self.runtime.monitor
        return monitor.energy_reading() if monitor is not None else (None, 0)

    def settle(self, summary: Any, client: RedisCommands, work: WorkOrder) -> None:
        if summary.skipped:
            return
        energy, gpus = self._energy()
        summary.energy_j, summary.gpu_s = batch_share(
            (self.energy[0], energy),
            self.runtime.feeder.tokens_total - self.tokens,
            summary.generated_tokens,
            time.monotonic() - self.started,
            gpus or len((self.runtime.settings.gpus or "0").split(",")),
        )
        _count_energy(client, work, summary)


def _count_energy(client: RedisCommands, work: WorkOrder, summary: Any) -> None:
    """Add the batch's energy and GPU time to the run (`status` and `report` show them);
    best effort: a lost counter must not fail a batch whose output is written."""
    try:
        pipe = client.pipeline()
        counters = keys.counters_key(work.run)
        pipe.hincrbyfloat(counters, "gpu_s", summary.gpu_s)
        pipe.hincrby(counters, "energy_tokens", summary.generated_tokens)
        if summary.energy_j is not None:
            pipe.hincrbyfloat(counters, "energy_j", summary.energy_j)
            pipe.hincrby(counters, "energy_batches", 1)
            pipe.hincrby(counters, "energy_batch_tokens", summary.generated_tokens)
        pipe.execute()
    except redis.RedisError:
        log.warning("could not count the energy of %s/%s", work.run, work.batch)


def _attempt(client: RedisCommands, work: WorkOrder) -> int:
    try:
        return int(client.hincrby(keys.attempts_key(work.run), work.batch, 1))
    except redis.RedisError:
        return 1


def retry_backoff_s(attempts: int) -> float:
    """How long a failed try waits before its retry is sent (a seam for tests)."""
    return min(2.0**attempts, 60.0)


def _back_off(
    client: RedisCommands, work: WorkOrder, worker: str, lease_ttl_s: float, attempts: int
) -> None:
    """Wait out the retry's backoff here, holding the lease, then send the retry due now.

    A retry sent with a countdown is held by whichever worker receives it until it is due; if
    that worker dies the copy is invisible to the reaper (no running entry, no lease) until the
    broker's visibility timeout, hours later. Waiting here keeps the batch in the running hash
    under a live lease instead, so a death during the wait is reaped like any other.
    """
    delay_s = retry_backoff_s(attempts)
    if delay_s <= 0:
        return
    try:
        with Lease(client, keys.lease_key(work.run, work.batch), worker, lease_ttl_s):
            time.sleep(delay_s)
    except redis.RedisError:
        time.sleep(delay_s)  # no lease to hold; the entry's claim time covers a death


def _retry_or_requeue(
    task: Task, field: str, exc: Exception, countdown: float, queue: str | None = None
) -> NoReturn:
    """Send the next try; if that cannot be sent (the broker is down), put this message back
    rather than let a failed task ack the only copy of the order."""
    try:
        raise task.retry(exc=exc, countdown=countdown, max_retries=None, queue=queue)
    except (Retry, Reject):
        raise
    except Exception as error:  # noqa: BLE001 - any failure to send the retry
        if error is exc:
            raise  # called outside a worker, `retry` re-raises the error itself
        raise Reject(f"{field}: retry not sent ({error}): requeued", requeue=True) from exc


def _fail(client: RedisCommands, work: WorkOrder, exc: BaseException) -> None:
    """Park the batch in the failed set with its last error; `genfleet retry` re-enqueues.

    When that cannot be recorded the message goes back to the queue: acking it would lose the
    order with no trace in the failed set."""
    try:
        pipe = client.pipeline()
        pipe.hset(keys.failed_key(work.run), work.batch, f"{type(exc).__name__}: {exc}"[:2000])
        pipe.srem(keys.queued_key(work.run), work.batch)
        pipe.hdel(keys.running_key(), running_field(work.run, work.batch))
        pipe.execute()
    except redis.RedisError as error:
        log.exception("could not record failed batch %s/%s: requeued", work.run, work.batch)
        raise Reject(f"failed set not written ({error}): requeued", requeue=True) from exc


def _safe_hdel(client: RedisCommands, field: str) -> None:
    try:
        client.hdel(keys.running_key(), field)
    except redis.RedisError:
        log.warning("could not clear running entry %s", field)


@app.task(name=REAPER_TASK)  # type: ignore[untyped-decorator]
def reap_leases() -> dict[str, Any]:
    """Re-enqueue running batches whose lease expired and whose output does not exist; park
    those whose worker died `max_deliveries` times."""
    from genfleet.common.redis_conn import connect
    from genfleet.common.store import store_of

    settings = settings_of(app)
    client, store = connect(settings), store_of(settings)

    def send(order: dict[str, Any]) -> None:
        generate_batch.apply_async(
            kwargs={"order": order}, queue=order_queue(settings.queue, order)
        )

    reaped = reap(client, store, settings.lease_ttl_s, time.time(), send, settings.max_deliveries)
    lost = reconcile_orders(client, store, settings.lease_ttl_s, lambda o: send(o.model_dump()))
    return {**reaped, "resent": lost["resent"]}


def reap(
    client: RedisCommands,
    store: Store,
    lease_ttl_s: float,
    now: float,
    requeue: Callable[[dict[str, Any]], object],
    max_deliveries: int = 3,
) -> dict[str, Any]:
    """One reaper pass over the running batches: a batch whose lease expired is finished when
    its output exists (its entry is dropped), else `requeue`d with its work order, once; or
    parked in the failed set when its worker died `max_deliveries` times."""
    found: dict[str, list[str]] = {"requeued": [], "finished": [], "parked": []}
    for field, raw in client.hgetall(keys.running_key()).items():
        entry = orjson.loads(raw)
        run, batch = entry["run"], entry["batch"]
        if client.exists(keys.lease_key(run, batch)):
            continue
        if now - float(entry.get("claimed_at", 0)) < lease_ttl_s:
            continue  # claimed but the first lease write may not have landed yet
        if store.exists(keys.output_key(run, batch)):
            client.hdel(keys.running_key(), field)
            found["finished"].append(text(field))
            continue
        if client.exists(keys.cancelled_key(run), keys.deleted_key(run)):
            order = {k: v for k, v in entry.items() if k not in ("claimed_at", "worker")}
            park(client, WorkOrder.model_validate(order))  # nothing to redo: parked
            continue
        if not client.hdel(keys.running_key(), field):
            continue  # another reaper won this one
        outcome = _lost(client, entry, requeue, max_deliveries)
        found[outcome].append(text(field))
    return {**found, "ts": now}


def _dead_deliveries(client: RedisCommands, run: str, batch: str) -> list[str]:
    """The broker's unacked copies of this order: the dead worker's delivery.

    The broker would deliver them again after its visibility timeout (hours later), a copy
    the reaper has replaced; and `retry` takes an unacked copy for an outstanding order, so it
    would not resend a parked batch. They are dropped (`_drop`) once the outcome is recorded;
    an ack for a dropped tag is a no-op.
    """
    tags: list[str] = []
    for tag, raw in client.hgetall(keys.UNACKED).items():
        try:
            message = orjson.loads(raw)[0]
        except (ValueError, IndexError, TypeError):
            continue
        if work_order_of(orjson.dumps(message)) == (run, batch):
            tags.append(text(tag))
    return tags


def _drop(client: RedisCommands, tags: list[str]) -> None:
    if tags:
        pipe = client.pipeline()
        pipe.hdel(keys.UNACKED, *tags)
        pipe.zrem(keys.UNACKED_INDEX, *tags)
        pipe.execute()


def _lost(
    client: RedisCommands,
    entry: dict[str, Any],
    requeue: Callable[[dict[str, Any]], object],
    max_deliveries: int,
) -> str:
    """A delivery ended with its worker dead or vanished: re-enqueue it, or park it as poison
    once that has happened `max_deliveries` times. Returns "requeued" or "parked"."""
    run, batch = entry["run"], entry["batch"]
    lost = int(client.hincrby(keys.lost_key(run), batch, 1))
    dead = _dead_deliveries(client, run, batch)
    if lost >= max_deliveries:
        reason = (
            f"poison batch: its worker died or vanished in {lost} deliveries (the last on "
            f"{entry.get('worker', 'an unknown worker')}); parked, `genfleet retry {run}` "
            "resends it"
        )
        pipe = client.pipeline()
        pipe.hset(keys.failed_key(run), batch, reason)
        pipe.srem(keys.queued_key(run), batch)
        pipe.execute()
        _drop(client, dead)
        log.error("%s/%s: %s", run, batch, reason)
        return "parked"
    order = {k: v for k, v in entry.items() if k not in ("claimed_at", "worker")}
    try:
        requeue(order)
    except Exception:
        # Not sent: give the entry back so the next round tries again (never lose the order).
        client.hincrby(keys.lost_key(run), batch, -1)
        client.hset(keys.running_key(), running_field(run, batch), orjson.dumps(entry))
        raise
    _drop(client, dead)
    log.warning(
        "lease of %s/%s expired without output: re-enqueued (delivery %d of at most %d ended "
        "with its worker gone)",
        run,
        batch,
        lost,
        max_deliveries,
    )
    return "requeued"


@app.task(name=POWER_WATCH_TASK)  # type: ignore[untyped-decorator]
def power_watch() -> dict[str, Any]:
    from genfleet.workers.observe.power_watch import run_power_watch

    return run_power_watch(app, settings_of(app))
