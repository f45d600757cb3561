"""The generate task: a thin wrapper that validates a message, calls one core function and
applies what a failure means.

generate_batch: a WorkOrder → `workers.admission.admit` (handed back, parked, dropped or
claimed) → `workers.batch.execute`. Retryable failures (engine down, store or Redis
unreachable) are retried with backoff; after `batch_retries` tries, or at once for permanent
ones (staged input missing, anything unforeseen), the batch lands in the run's failed set
(`workers.outcome` decides, as data; `_apply` does what it says). An engine that refuses the
worker itself (401/403/404: key, URL, model name) is no batch's fault: the order goes back to
the queue untouched and this worker stops consuming, saying why.

The control worker's beat tasks (reaper, reconcile, power-watch) are `workers.control.beat`'s.
"""

from __future__ import annotations

import logging
import time
from typing import Any, NoReturn

import redis
from celery import Task
from celery.exceptions import Reject, Retry

from genfleet.common import counters, keys
from genfleet.common.backoff import BATCH_RETRY
from genfleet.common.celery_config import GENERATE_TASK
from genfleet.common.errors import BatchFailed
from genfleet.common.ledger import Ledger, running_field
from genfleet.common.quality import gate_settings
from genfleet.common.records import WorkOrder
from genfleet.common.redis_conn import RedisCommands
from genfleet.workers.admission import admit, fail_order, is_cancelled
from genfleet.workers.app import app
from genfleet.workers.batch import execute
from genfleet.workers.context import BatchTask, TaskRuntime
from genfleet.workers.lease import Lease
from genfleet.workers.observe.headlines import batch_headline, not_generated_headline
from genfleet.workers.observe.sampler import batch_share
from genfleet.workers.outcome import Outcome, counts_a_try, outcome
from genfleet.workers.process.pool import BatchRequest

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
    early = admit(runtime, work, order, worker)
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
            journal_interval_s=settings.inflight_journal_interval_s,
            gpus=settings.gpus,
            cancelled=lambda: is_cancelled(client, work.run),
            lease_client=runtime.lease_redis,
            progress=runtime.progress,
            gate=gate_settings(settings),
            handing_back=lambda: runtime.handing_back(work.run, work.batch),
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
        if ledger.park(work.run, work.batch):
            parked = {"run": work.run, "batch": work.batch, "cancelled": True}
            return {"summary": not_generated_headline(parked), **parked}
        # Resumed while the batch stopped: the order is outstanding for the resume (it listed
        # it), so its message goes back and the checkpoint is where the next try starts.
        _safe_release(ledger, work)
        raise Reject(f"{running_field(work.run, work.batch)}: resumed: requeued", requeue=True)
    if verdict.action == "drop":
        # Not this run's order any more: its batch's state (queued, failed) belongs to the
        # staging that replaced it, so only this delivery's running entry goes, and only
        # while it is this staging's (the new staging's batch of the same name may run).
        log.error("%s", exc)
        try:
            ledger.release_staging(work.run, work.batch, work.staging)
        except redis.RedisError:
            log.warning("could not clear running entry %s", running_field(work.run, work.batch))
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
    fail_order(runtime.redis, work, verdict.failed_reason, exc)
    raise BatchFailed(verdict.message) from exc


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
        counters.add_energy(
            client, work.run, summary.gpu_s, summary.generated_tokens, summary.energy_j
        )
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


def _safe_release(ledger: Ledger, work: WorkOrder) -> None:
    try:
        ledger.release(work.run, work.batch)
    except redis.RedisError:
        log.warning("could not clear running entry %s", running_field(work.run, work.batch))
