"""Whether a worker may generate a work order it received: the run's model, cancel and delete,
poison, the staging it names and the checkpoint it asks for, checked once, before the claim.

Checked when a batch starts (or resumes, on a redelivery) and, for cancel, while it runs:

- an order for another model goes back to its own queue, never generated here (a worker
  serves one model; the emulator is a model of its own);
- an order of a deleted run is dropped: a run of the same name staged since then must never
  receive another incarnation's batch. The deletion's tombstone names the staging it
  deleted, and an order names its staging, so no clock of two hosts is compared (the
  store's claim is checked again before every write: `genfleet.workers.provenance`);
- an order of a cancelled run is parked: acknowledged, not generated; its checkpoint stays,
  and enqueueing the run again (`genfleet enqueue --resume RUN`) sends it anew;
- an order of a run whose model (recorded at staging, `common.model_identity`) this worker does
  not serve goes back to the end of its queue for another worker: not failed, no try spent,
  and this worker goes on with other runs' orders (`workers.refusals`: no hot loop on it).

While a batch runs, its lease (`genfleet.workers.lease`) says a live worker holds it.
"""

from __future__ import annotations

import logging
import time
from typing import Any, Literal

import redis
from celery.exceptions import Reject

from genfleet.common import keys, model_identity
from genfleet.common.celery_config import GENERATE_TASK
from genfleet.common.errors import BatchFailed, BatchSuperseded, StoreError, ThinkingUnsupported
from genfleet.common.ledger import Ledger, running_field
from genfleet.common.records import WorkOrder
from genfleet.common.redis_conn import RedisCommands, server_time
from genfleet.common.routing import order_queue
from genfleet.workers.app import app
from genfleet.workers.context import TaskRuntime
from genfleet.workers.observe.headlines import not_generated_headline
from genfleet.workers.provenance import ensure_current, thinking_refusal

log = logging.getLogger("genfleet.tasks")

Admission = Literal["generate", "hand_back", "drop", "park"]


def decide(my_queue: str, its_queue: str, deleted: bool, cancelled: bool) -> Admission:
    """What to do with an order, from the facts alone (a table test covers every row).
    `deleted`: the order's staging is the one a deletion removed (`deleted_staging`)."""
    if its_queue != my_queue:
        return "hand_back"
    if deleted:
        return "drop"
    if cancelled:
        return "park"
    return "generate"


def gate(
    client: RedisCommands, work: WorkOrder, my_queue: str, its_queue: str
) -> dict[str, Any] | None:
    """None when this worker should generate `work`; else the task's result saying why not
    (for `hand_back`, the caller sends the order to `queue`)."""
    tombstone = client.get(keys.deleted_key(work.run))
    verdict = decide(
        my_queue,
        its_queue,
        deleted_staging(tombstone, work.staging),
        is_cancelled(client, work.run),
    )
    result: dict[str, Any] = {"run": work.run, "batch": work.batch, verdict: True}
    if verdict == "generate":
        return None
    if verdict == "hand_back":
        log.warning(
            "%s/%s is for model %r (%s), but this worker serves queue %s: handed back to %s, "
            "not generated",
            work.run,
            work.batch,
            work.model,
            work.engine,
            my_queue,
            its_queue,
        )
        result["handed_back"] = True
        result["queue"] = its_queue
    elif verdict == "drop":
        log.warning("%s/%s belongs to a deleted run: dropped", work.run, work.batch)
    elif Ledger(client).park(work.run, work.batch):
        log.warning("%s/%s: the run is cancelled; batch parked, not started", work.run, work.batch)
    else:
        return None  # resumed since it was read: the order is the resumed run's to generate
    return result


def deleted_staging(tombstone: bytes | str | None, staging: str) -> bool:
    """Whether a deletion's tombstone (`keys.deleted_key`, holding the staging id it
    deleted) covers an order of `staging`. An order of an older genfleet names no staging:
    every one is dropped while the tombstone lives."""
    if tombstone is None:
        return False
    deleted = tombstone.decode() if isinstance(tombstone, bytes) else str(tombstone)
    return not staging or deleted == staging


def is_cancelled(client: RedisCommands, run: str) -> bool:
    """Polled by a running batch at each lease refresh."""
    return bool(client.exists(keys.cancelled_key(run)))


def admit(
    runtime: TaskRuntime, work: WorkOrder, order: dict[str, Any], worker: str
) -> dict[str, Any] | None:
    """Claim the batch (its running entry), or say why it is not generated here (the task's
    result). The one place an order is admitted: its queue, cancel and delete, poison, its
    staging (`provenance.ensure_current`) and the model it asks for are checked here, once.
    A Redis failure here comes after the message was taken and before anything is recorded:
    the message goes back to the queue, never acked."""
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
        refused = _check_model(runtime, work)
        if refused is not None:
            return _hand_back_refused(runtime, work, order, refused)
        # Stamped by Redis's clock, the one the reaper compares it with (not this host's).
        ledger.claim(order, worker, server_time(client), runtime.presence_name)
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
    """Send the order to the end of `queue` (its own model's, or this worker's for a run it
    does not serve); when the broker does not take it, put this message back instead (acking
    it would lose the only copy of the order).

    Any failure counts, not only kombu's OperationalError: after a publish failed with the
    connection, the next one on the same producer can raise AttributeError from inside kombu
    (its channel's connection is gone), and a task that raises that is acked.
    """
    try:
        app.send_task(GENERATE_TASK, kwargs={"order": order}, queue=queue)
    except Exception as exc:  # noqa: BLE001 - any failure to send the hand-back
        raise Reject(
            f"{field}: not handed back to {queue} ({exc!r}): requeued", requeue=True
        ) from exc


def _check_model(runtime: TaskRuntime, work: WorkOrder) -> model_identity.Verdict | None:
    """None when this worker's model answers the order as the run asks; the verdict when the
    run's recorded model (`common.model_identity`) is not the one this worker serves, judged
    once per run and staging (`workers.refusals`). On the run's model, `--no-thinking` where
    the model has no switch fails the batch (no worker of this model could honour it)."""
    identity = runtime.model_identity
    if identity is None:
        return None
    verdicts = runtime.model_verdicts
    verdict = verdicts.known(work.run, work.staging)
    if verdict is None:
        verdict = model_identity.judge(model_identity.read(runtime.store, work.run), identity)
        if verdicts.remember(work.run, work.staging, verdict):
            _tell(runtime, work, verdict)
    if not verdict.serves:
        return verdict  # another worker's to judge, thinking and all
    refused = thinking_refusal(work, identity)
    if refused is not None:
        error = ThinkingUnsupported(refused)
        fail_order(runtime.redis, work, f"{type(error).__name__}: {error}", error)
        raise BatchFailed(refused) from error
    return None


def _hand_back_refused(
    runtime: TaskRuntime,
    work: WorkOrder,
    order: dict[str, Any],
    verdict: model_identity.Verdict,
) -> dict[str, Any]:
    """Send an order of a run this worker does not serve to the end of its queue, for another
    worker (not failed, no try spent, nothing claimed); then this batch slot rests
    `refused_order_rest_s` before it takes another order, so that a queue whose only workers
    refuse the run goes round slowly, never in a hot loop, while the worker's other slots go
    on with other runs' orders.

    The copy goes out at once, the rest after: the broker hands a message to the consumer
    that has waited longest, and this worker's has only just asked again, so a worker that
    serves the run gets it first. (Resting first and handing back after would give it to this
    worker again, whose request would then be the oldest.)"""
    _hand_back(order, runtime.queue, running_field(work.run, work.batch))
    rest_s = runtime.settings.refused_order_rest_s
    if rest_s > 0:
        time.sleep(rest_s)
    result = {
        "run": work.run,
        "batch": work.batch,
        "handed_back": True,
        "queue": runtime.queue,
        "refused": verdict.why(),
    }
    return {"summary": not_generated_headline(result), **result}


def _tell(runtime: TaskRuntime, work: WorkOrder, verdict: model_identity.Verdict) -> None:
    """Say once per verdict what this worker found about the run's model: a refusal as a
    finding naming the worker, the run and the difference, and in the run's refusals that
    `status` reads; a run served by name where content could not be compared, in the log."""
    worker = runtime.hostname
    if verdict.serves:
        if verdict.note:
            log.warning("%s: run %s judged by name: %s", worker, work.run, verdict.note)
        try:
            model_identity.clear_refusal(runtime.redis, work.run, worker)
        except redis.RedisError as exc:
            log.warning("could not clear a refusal of run %s: %s", work.run, exc)
        return
    log.error(
        "%s does not serve the model of run %s (%s): its orders are handed back; this worker "
        "goes on with other runs",
        worker,
        work.run,
        verdict.why(),
    )
    memory_s = runtime.settings.refused_run_memory_s
    try:
        model_identity.note_refusal(
            runtime.redis, work.run, worker, work.staging, verdict, memory_s
        )
    except redis.RedisError as exc:
        log.warning("could not note the refusal of run %s: %s", work.run, exc)
    identity = runtime.model_identity or {}
    runtime.finding(
        "model_mismatch",
        {
            **verdict.to_json(),
            "checkpoint": identity.get("checkpoint"),
            "fingerprint": identity.get("fingerprint"),
        },
        f"run {work.run}: {verdict.why()}. This worker hands the run's orders back and goes "
        f"on with other runs'; a worker serving the run's model generates it (start one with "
        f"the run's --model and engine settings)",
        verdict="refused",
        run=work.run,
    )


def fail_order(client: RedisCommands, work: WorkOrder, reason: str, exc: BaseException) -> None:
    """Park the batch in the failed set with its last error; `genfleet retry` re-enqueues.

    When that cannot be recorded the message goes back to the queue: acking it would lose the
    order with no trace in the failed set."""
    try:
        Ledger(client).fail(work.run, work.batch, reason)
    except redis.RedisError as error:
        log.exception("could not record failed batch %s/%s: requeued", work.run, work.batch)
        raise Reject(f"failed set not written ({error}): requeued", requeue=True) from exc
