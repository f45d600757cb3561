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
- reconcile_progress (beat): repairs Redis's progress copy (what `status` reads) from the
  store's listing of each running run's outputs (genfleet.common.reconcile.reconcile_runs).
- power_watch (beat): see genfleet.workers.observe.power_watch.
"""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import Callable
from typing import Any, NoReturn

import redis
from celery import Task
from celery.exceptions import Reject, Retry

from genfleet.common import keys
from genfleet.common.backoff import BATCH_RETRY
from genfleet.common.celery_config import (
    GENERATE_TASK,
    POWER_WATCH_TASK,
    REAPER_TASK,
    RECONCILE_TASK,
)
from genfleet.common.errors import BatchFailed, BatchSuperseded, StoreError, ThinkingUnsupported
from genfleet.common.ledger import Delivery, Ledger, Running, UnackedIndex, running_field
from genfleet.common.records import WorkOrder
from genfleet.common.redis_conn import RedisCommands
from genfleet.common.routing import order_queue
from genfleet.common.store import Store
from genfleet.workers.app import app, settings_of
from genfleet.workers.batch import execute
from genfleet.workers.context import BatchTask, BeatTask, TaskRuntime
from genfleet.workers.lifecycle import Lease, gate, is_cancelled
from genfleet.workers.liveness import present
from genfleet.workers.observe.headlines import batch_headline, not_generated_headline
from genfleet.workers.observe.sampler import batch_share
from genfleet.workers.outcome import Outcome, counts_a_try, outcome
from genfleet.workers.pool import BatchRequest
from genfleet.workers.provenance import ensure_current, model_refusal, thinking_refusal
from genfleet.workers.reconcile import Lapses, reconcile_orders
from genfleet.workers.reconnect import HeldRequest

log = logging.getLogger("genfleet.tasks")


@app.task(name=GENERATE_TASK, bind=True, base=BatchTask, Request=BatchRequest)  # type: ignore[untyped-decorator]
def generate_batch(self: BatchTask, order: dict[str, Any]) -> dict[str, Any]:
    work = WorkOrder.model_validate(order)
    runtime = self.worker_runtime()
    settings = runtime.settings
    client = runtime.redis
    assert runtime.feeder is not None
    field = running_field(work.run, work.batch)
    ledger = Ledger(client)
    worker = self.request.hostname or runtime.hostname
    early = _admit(runtime, work, order, worker)
    if early is not None:
        return early
    monitor = runtime.monitor
    if monitor is not None:
        monitor.batch_started(work.run)
    spend = _Spend(runtime)
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
            progress=runtime.progress,
        )
    except Exception as exc:
        attempts = _attempt(client, work) if counts_a_try(exc) else 0
        verdict = outcome(exc, field, attempts, settings.batch_retries, BATCH_RETRY)
        return _apply(self, runtime, work, worker, verdict, exc)
    finally:
        runtime.batch_ended(work.run, work.batch)
        if monitor is not None:
            monitor.batch_finished(work.run)
    _safe_release(ledger, work)
    spend.settle(summary, client, work)
    runtime.after_batch(summary)
    figures = summary.to_json()
    # The line first: Flower shows it; every figure stays in the result after it.
    return {"summary": batch_headline(figures), **figures}


def _apply(
    task: Task, runtime: TaskRuntime, work: WorkOrder, worker: str, verdict: Outcome, exc: Exception
) -> dict[str, Any]:
    """Do what `verdict` says with the failed try: the task's result (parked) or the error
    that tells Celery what follows (Reject: back to the queue; Retry; BatchFailed: acked,
    in the failed set)."""
    ledger = Ledger(runtime.redis)
    if verdict.action == "park":
        log.warning("%s", exc)
        ledger.park(work.run, work.batch)
        parked = {"run": work.run, "batch": work.batch, "cancelled": True}
        return {"summary": not_generated_headline(parked), **parked}
    if verdict.action == "drop":
        # Not this run's order any more: its batch's state (queued, failed) belongs to the
        # staging that replaced it, so only this delivery's running entry goes.
        log.error("%s", exc)
        _safe_release(ledger, work)
        dropped = {"run": work.run, "batch": work.batch, "drop": True, "superseded": True}
        return {"summary": not_generated_headline(dropped), **dropped}
    if verdict.action == "hand_back":
        # Every prompt would get the same answer: spend no try, hand the order back for a
        # worker that is configured right, and stop this one taking more.
        _safe_release(ledger, work)
        runtime.refuse_work(f"{work.run}/{work.batch} handed back: {exc}")
        raise Reject(verdict.message, requeue=True) from exc
    if verdict.action == "requeue":
        # Shutting down: put the message back for another worker (or this one, restarted);
        # the retry skips the prompts the checkpoint holds. Not a try, not a failure.
        log.warning("%s", exc)
        _safe_release(ledger, work)
        raise Reject(verdict.message, requeue=True) from exc
    field = running_field(work.run, work.batch)
    if verdict.action == "retry":
        log.warning("%s", verdict.message)
        _back_off(runtime.lease_redis, work, worker, runtime.settings.lease_ttl_s, verdict.delay_s)
        _safe_release(ledger, work)
        _retry_or_requeue(task, field, exc, countdown=0, queue=runtime.queue)
    if verdict.unforeseen:
        log.exception("%s failed unexpectedly", field)
    _fail(runtime.redis, work, verdict.failed_reason, exc)
    raise BatchFailed(verdict.message) from exc


def _admit(
    runtime: TaskRuntime, work: WorkOrder, order: dict[str, Any], worker: str
) -> dict[str, Any] | None:
    """Claim the batch (its running entry), or say why it is not generated here (the task's
    result). A Redis failure here comes after the message was taken and before anything is
    recorded: the message goes back to the queue, never acked."""
    client, settings = runtime.redis, runtime.settings
    field = running_field(work.run, work.batch)
    ledger = Ledger(client)
    try:
        turned_away = gate(client, work, runtime.queue, order_queue(settings.queue, order))
        if turned_away is not None:
            if turned_away.get("handed_back"):
                _hand_back(order, turned_away["queue"], field)
            return {"summary": not_generated_headline(turned_away), **turned_away}
        if ledger.is_poison(work.run, work.batch, settings.max_deliveries):
            # A stale copy (the broker's redelivery after its visibility timeout) of a batch
            # parked as poison: running it would crash one more worker.
            log.error("%s/%s is parked as poison: not running it", work.run, work.batch)
            return {"run": work.run, "batch": work.batch, "worker": worker, "parked": True}
        # Before the claim: an order of a superseded staging must not take the running entry
        # of the run's batch of the same name (the new staging's, maybe running elsewhere).
        ensure_current(runtime.store, work)
        # Also before the claim: its store read must not stand between the running entry and
        # the lease (taken by `execute` before any other read), or a slow store lets the
        # reaper take a batch whose worker is alive.
        _check_model(runtime, work)
        ledger.claim(order, worker, time.time(), runtime.presence_name)
    except (redis.RedisError, StoreError) as exc:
        raise Reject(
            f"{field}: Redis or the store failed before the batch started: {exc}", requeue=True
        ) from exc
    except BatchSuperseded as exc:
        log.error("%s", exc)
        dropped = {"run": work.run, "batch": work.batch, "drop": True, "superseded": True}
        return {"summary": not_generated_headline(dropped), **dropped}
    return None


def _hand_back(order: dict[str, Any], queue: str, field: str) -> None:
    """Send the order to its own model's queue; when the broker does not take it, put this
    message back instead (acking it would lose the only copy of the order).

    Any failure counts, not only kombu's OperationalError: after a publish failed with the
    connection, the next one on the same producer can raise AttributeError from inside kombu
    (its channel's connection is gone), and a task that raises that is acked.
    """
    try:
        generate_batch.apply_async(kwargs={"order": order}, queue=queue)
    except Exception as exc:  # noqa: BLE001 - any failure to send the hand-back
        raise Reject(
            f"{field}: not handed back to {queue} ({exc!r}): requeued", requeue=True
        ) from exc


def _check_model(runtime: TaskRuntime, work: WorkOrder) -> None:
    """Refuse an order this worker's model cannot answer as the run asks: another checkpoint
    than the run's is handed back (this worker stops taking work, saying why); `--no-thinking`
    on a model without a switch fails the batch (no worker of this model could honour it)."""
    identity = runtime.model_identity
    if identity is None:
        return
    refused = thinking_refusal(work, identity)
    if refused is not None:
        error = ThinkingUnsupported(refused)
        _fail(runtime.redis, work, f"{type(error).__name__}: {error}", error)
        raise BatchFailed(refused) from error
    if work.run in runtime.model_runs:
        return
    reason = model_refusal(runtime.store, work.run, identity)
    if reason is None:
        runtime.model_runs.add(work.run)
        return
    log.error("%s/%s: %s", work.run, work.batch, reason)
    runtime.refuse_work(f"{work.run}/{work.batch} handed back: {reason}")
    raise Reject(reason, requeue=True)


class _Spend:
    """The batch's GPU energy and time: readings when it starts, its share when it ends."""

    def __init__(self, runtime: TaskRuntime) -> None:
        assert runtime.feeder is not None
        self.runtime = runtime
        self.feeder = runtime.feeder
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
            self.feeder.tokens_total - self.tokens,
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
        return Ledger(client).tried(work.run, work.batch)
    except redis.RedisError:
        return 1


def _back_off(
    client: RedisCommands, work: WorkOrder, worker: str, lease_ttl_s: float, delay_s: float
) -> None:
    """Wait out the retry's backoff here, holding the lease, then send the retry due now.

    A retry sent with a countdown is held by whichever worker receives it until it is due; if
    that worker dies the copy is invisible to the reaper (no running entry, no lease) until the
    broker's visibility timeout, hours later. Waiting here keeps the batch in the running hash
    under a live lease instead, so a death during the wait is reaped like any other.
    """
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
    except Retry:
        raise
    except Reject as rejected:
        if rejected.requeue:
            raise
        # Celery answers a retry it could not send with Reject(requeue=False): the only copy
        # of the order dropped, and first its failure written to the result backend, which
        # raises while Redis is away, so the message was neither acked nor put back.
        raise Reject(
            f"{field}: retry not sent ({rejected.reason}): requeued", requeue=True
        ) from exc
    except Exception as error:  # noqa: BLE001 - any failure to send the retry
        if error is exc:
            raise  # called outside a worker, `retry` re-raises the error itself
        raise Reject(f"{field}: retry not sent ({error}): requeued", requeue=True) from exc


def _fail(client: RedisCommands, work: WorkOrder, reason: str, exc: BaseException) -> None:
    """Park the batch in the failed set with its last error; `genfleet retry` re-enqueues.

    When that cannot be recorded the message goes back to the queue: acking it would lose the
    order with no trace in the failed set."""
    try:
        Ledger(client).fail(work.run, work.batch, reason)
    except redis.RedisError as error:
        log.exception("could not record failed batch %s/%s: requeued", work.run, work.batch)
        raise Reject(f"failed set not written ({error}): requeued", requeue=True) from exc


def _safe_release(ledger: Ledger, work: WorkOrder) -> None:
    try:
        ledger.release(work.run, work.batch)
    except redis.RedisError:
        log.warning("could not clear running entry %s", running_field(work.run, work.batch))


@app.task(name=REAPER_TASK, base=BeatTask, Request=HeldRequest)  # type: ignore[untyped-decorator]
def reap_leases() -> dict[str, Any]:
    """Re-enqueue running batches whose worker is gone (its lease expired, or its connection
    with Redis, workers/liveness.py) and whose output does not exist; give back the orders a
    dead worker received and never claimed; park those whose worker died `max_deliveries`
    times."""
    from genfleet.common.redis_conn import connect
    from genfleet.common.store import store_of

    settings = settings_of(app)
    client, store = connect(settings), store_of(settings)

    def send(order: dict[str, Any]) -> None:
        generate_batch.apply_async(
            kwargs={"order": order}, queue=order_queue(settings.queue, order)
        )

    token = uuid.uuid4().hex
    lock, ttl_ms = keys.reaping_key(), max(int(settings.lease_ttl_s * 1000), 1)
    if not client.set(lock, token, nx=True, px=ttl_ms):
        # The last beat's pass still runs (slow under load, or Redis was away): one at a time.
        empty: dict[str, list[str]] = {k: [] for k in REAPED}
        return {**empty, "ts": time.time(), "resent": [], "skipped": True}
    try:
        reaped = reap(
            client,
            store,
            settings.lease_ttl_s,
            time.time(),
            send,
            settings.max_deliveries,
            present=present(client),
        )
        lost = reconcile_orders(client, store, settings.lease_ttl_s, lambda o: send(o.model_dump()))
    finally:
        if client.get(lock) == token.encode():
            client.delete(lock)
    return {**reaped, "resent": lost["resent"]}


REAPED = ("requeued", "finished", "parked", "given_back")  # what a reaper pass reports


def reap(
    client: RedisCommands,
    store: Store,
    lease_ttl_s: float,
    now: float,
    requeue: Callable[[dict[str, Any]], object],
    max_deliveries: int = 3,
    present: set[str] | None = None,
) -> dict[str, Any]:
    """One reaper pass over the running batches: a batch whose worker is gone is finished
    when its output exists (its entry is dropped), else `requeue`d with its work order, once;
    or parked in the failed set when its worker died `max_deliveries` times. Then the orders
    delivered to a gone worker and never claimed go the same way.

    Gone, on two looks half a lease apart: its lease expired, or (`present`: the names of the
    workers' connections Redis holds, None when unknown) its worker's connection is not
    there. The second is known a lease sooner: a dead process's connections close at once."""
    found: dict[str, list[str]] = {k: [] for k in REAPED}
    ledger = Ledger(client)
    lapses = Lapses(client, lease_ttl_s)  # type: ignore[arg-type]
    deliveries = ledger.deliveries()  # before the unacked hash: see _unclaimed
    unacked = ledger.unacked_index()  # scanned once a pass, when first asked
    running = ledger.running()
    for claimed in running:
        run, batch = claimed.run, claimed.batch
        absent = _absent(claimed.presence, present)
        if not absent and client.exists(keys.lease_key(run, batch)):
            continue
        if not absent and now - claimed.claimed_at < lease_ttl_s:
            continue  # claimed but the first lease write may not have landed yet
        if not lapses.confirmed(claimed.field, now):
            continue  # a first look: a live worker re-sets its lease within a heartbeat
        if store.exists(keys.output_key(run, batch)):
            ledger.release(run, batch)
            found["finished"].append(claimed.field)
            continue
        if client.exists(keys.cancelled_key(run), keys.deleted_key(run)):
            ledger.park(run, batch)  # nothing to redo: parked
            continue
        if not ledger.release_claim(claimed):
            continue  # another reaper won this one, or a live worker claimed it again
        outcome = _lost(ledger, unacked, claimed, requeue, max_deliveries)
        found[outcome].append(claimed.field)
    claimed_fields = {c.field for c in running}
    orphans = _unclaimed(ledger, unacked, deliveries, claimed_fields, present, lapses, now)
    for orphan in orphans:
        if store.exists(keys.output_key(orphan.run, orphan.batch)):
            ledger.drop_unacked(unacked.copies(orphan.run, orphan.batch))
            continue
        outcome = _lost(ledger, unacked, orphan, requeue, max_deliveries)
        found["given_back" if outcome == "requeued" else outcome].append(orphan.field)
    lapses.forget_others()
    return {**found, "ts": now}


def _absent(name: str | None, present: set[str] | None) -> bool:
    """Whether a worker's named connection is known to be gone (never for an unnamed one)."""
    return present is not None and name is not None and name not in present


def _unclaimed(
    ledger: Ledger,
    unacked: UnackedIndex,
    deliveries: dict[str, Delivery],
    claimed: set[str],
    present: set[str] | None,
    lapses: Lapses,
    now: float,
) -> list[Running]:
    """The work orders delivered to a worker that is gone and never claimed (no running
    entry), each as the claim it never made. Their owner is recorded at delivery
    (`Ledger.delivered`); an order with no owner on record for half a lease is one whose
    worker died before it could record it. The deliveries kombu no longer holds are forgotten
    (`deliveries` was read before the unacked hash, so none is forgotten as it arrives)."""
    orphans: list[Running] = []
    ledger.forget_deliveries(set(deliveries) - {u.tag for u in unacked.orders()})
    for order in unacked.orders():
        field = running_field(order.run, order.batch)
        if field in claimed:
            continue
        owner = deliveries.get(order.tag)
        if owner is not None and not _absent(owner.presence, present):
            continue  # its worker lives (or cannot be judged): it claims it, or acks it
        if not lapses.confirmed(f"delivered:{order.tag}", now):
            continue
        worker = owner.worker if owner is not None else "a worker that never said so"
        orphans.append(Running(field, {**order.order, "worker": worker}))
    return orphans


def _lost(
    ledger: Ledger,
    unacked: UnackedIndex,
    claimed: Running,
    requeue: Callable[[dict[str, Any]], object],
    max_deliveries: int,
) -> str:
    """A delivery ended with its worker dead or vanished: re-enqueue it, or park it as poison
    once that has happened `max_deliveries` times. Returns "requeued" or "parked".

    The broker's unacked copies of the order (the dead worker's delivery) would be delivered
    again after its visibility timeout, hours later, a copy the reaper has replaced; and
    `retry` takes an unacked copy for an outstanding order, so it would not resend a parked
    batch. They are dropped once the outcome is recorded; an ack for a dropped tag is a no-op.
    """
    run, batch = claimed.run, claimed.batch
    lost = ledger.lost(run, batch)
    dead = unacked.copies(run, batch)
    if lost >= max_deliveries:
        reason = (
            f"poison batch: its worker died or vanished in {lost} deliveries (the last on "
            f"{claimed.worker}); parked, `genfleet retry {run}` resends it"
        )
        ledger.poison(run, batch, reason)
        ledger.drop_unacked(dead)
        log.error("%s/%s: %s", run, batch, reason)
        return "parked"
    try:
        requeue(claimed.order())
    except Exception:
        # Not sent: give the entry back so the next round tries again (never lose the order).
        ledger.unlose(claimed)
        raise
    ledger.drop_unacked(dead)
    log.warning(
        "%s/%s: its worker %s is gone and it has no output: re-enqueued (delivery %d of at "
        "most %d ended with its worker gone)",
        run,
        batch,
        claimed.worker,
        lost,
        max_deliveries,
    )
    return "requeued"


@app.task(name=POWER_WATCH_TASK, base=BeatTask, Request=HeldRequest)  # type: ignore[untyped-decorator]
def power_watch() -> dict[str, Any]:
    from genfleet.workers.observe.power_watch import run_power_watch

    return run_power_watch(app, settings_of(app))


@app.task(name=RECONCILE_TASK, base=BeatTask)  # type: ignore[untyped-decorator]
def reconcile_progress() -> dict[str, Any]:
    """Repair every running run's progress copy in Redis from its outputs in the store."""
    from genfleet.common.reconcile import reconcile_runs
    from genfleet.common.redis_conn import connect
    from genfleet.common.store import store_of

    settings = settings_of(app)
    now = time.time()
    done = reconcile_runs(store_of(settings), connect(settings), now)
    for repair in done.repairs:
        log.warning("progress of %s repaired from the store: %s", repair.run, repair.to_json())
    return {
        "ts": now,
        "repaired": [repair.to_json() for repair in done.repairs],
        "retired": done.retired,
        "failed": done.failed,
    }
