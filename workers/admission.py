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
  and enqueueing the run again (`genfleet enqueue --resume RUN`) sends it anew.

While a batch runs, its lease (`genfleet.workers.lease`) says a live worker holds it.
"""

from __future__ import annotations

import logging
from typing import Any, Literal

import redis
from celery.exceptions import Reject

from genfleet.common import keys
from genfleet.common.celery_config import GENERATE_TASK
from genfleet.common.errors import BatchFailed, BatchSuperseded, StoreError, ThinkingUnsupported
from genfleet.common.ledger import Ledger, running_field
from genfleet.common.records import WorkOrder
from genfleet.common.redis_conn import RedisCommands, server_time
from genfleet.common.routing import order_queue
from genfleet.workers.app import app
from genfleet.workers.context import TaskRuntime
from genfleet.workers.observe.headlines import not_generated_headline
from genfleet.workers.provenance import ensure_current, model_refusal, thinking_refusal

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
        _check_model(runtime, work)
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
    """Send the order to its own model's queue; when the broker does not take it, put this
    message back instead (acking it would lose the only copy of the order).

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
        fail_order(runtime.redis, work, f"{type(error).__name__}: {error}", error)
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


def fail_order(client: RedisCommands, work: WorkOrder, reason: str, exc: BaseException) -> None:
    """Park the batch in the failed set with its last error; `genfleet retry` re-enqueues.

    When that cannot be recorded the message goes back to the queue: acking it would lose the
    order with no trace in the failed set."""
    try:
        Ledger(client).fail(work.run, work.batch, reason)
    except redis.RedisError as error:
        log.exception("could not record failed batch %s/%s: requeued", work.run, work.batch)
        raise Reject(f"failed set not written ({error}): requeued", requeue=True) from exc
