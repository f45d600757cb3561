"""Celery's threads pool, able to stop running batches when Celery asks it to.

Threads cannot be killed, and Celery's own threads pool answers a request to terminate a job
(a cold shutdown: SIGQUIT or a second Ctrl-C) with NotImplementedError, after which
the worker hangs. Here terminating means cancelling the worker's running batches: each one
checkpoints what finished and hands its batch back to the queue, so the stop completes and
nothing is lost.

Terminating one task (Flower's "terminate", `revoke(task_id, terminate=True)`) goes through
`BatchRequest.terminate` instead, which cancels that task's batch only.

The worker processes of one node (`worker --gpus`) are `workers.process.children`'s.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import redis
from billiard.einfo import ExceptionInfo
from celery.concurrency.base import apply_target
from celery.concurrency.thread import ApplyResult
from celery.concurrency.thread import TaskPool as ThreadTaskPool
from celery.exceptions import Reject

from genfleet.common.ledger import Ledger
from genfleet.workers.context import BatchTask
from genfleet.workers.process.reconnect import HeldRequest

log = logging.getLogger("genfleet.worker")


# Threads per batch slot. A batch whose prompts are all in the engine hands its slot to the
# next batch while the engine has room (`workers.process.slots`), so the pool needs threads
# beyond `worker_concurrency` for those batches to finish on. The engine's room bounds what a
# worker holds; the threads must not bind first: a batch of long answers holds its thread for
# its last straggler, and in the chaos bench (25-prompt batches, 3 slots) a worker's 24
# threads were all stragglers' while its engine ran 71 to 110 of 256 with orders waiting. An
# idle thread costs a blocked wait, no more.
THREADS_PER_SLOT = 32


class TaskPool(ThreadTaskPool):  # type: ignore[misc]
    """`limit` (worker_concurrency) is the batch budget Celery prefetches for; the executor
    has THREADS_PER_SLOT times as many threads for batches that released their slot."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        getattr(self, "executor").shutdown(wait=False)  # noqa: B009 - no thread started yet
        self.executor: ThreadPoolExecutor = ThreadPoolExecutor(
            max_workers=int(self.limit) * THREADS_PER_SLOT
        )

    @property
    def spare_threads(self) -> int:
        """Batches that may run beyond the budget: one released slot each."""
        return int(self.limit) * (THREADS_PER_SLOT - 1)

    def on_apply(
        self,
        target: Callable[..., Any],
        args: tuple[Any, ...] | None = None,
        kwargs: dict[str, Any] | None = None,
        callback: Callable[..., Any] | None = None,
        accept_callback: Callable[..., Any] | None = None,
        error_callback: Callable[..., Any] | None = None,
        **_: Any,
    ) -> ApplyResult:
        """Celery's threads pool runs a task and drops `error_callback`: an error raised
        around the task's body (its STARTED state or its failure written to a result backend
        that is away, its `task-started` event not sent) ends in the thread's future, which
        nobody reads. The request then stays active for good, its message neither acked nor
        handed back, holding a prefetch slot: after a Redis blip at the wrong moment the
        worker took nothing more. Here such an error hands the message back to the queue
        (`Reject(requeue=True)` through the request's `on_failure`): the order runs again,
        and one whose output exists is skipped."""

        def run() -> None:
            try:
                apply_target(target, args, kwargs, callback, accept_callback)
            except Exception as exc:  # noqa: BLE001 - any error outside the task's own handling
                log.warning("a task ended outside its body (%r): its order goes back", exc)
                if error_callback is not None:
                    error_callback(_handed_back(exc))

        return ApplyResult(self.executor.submit(run))

    def terminate_job(self, pid: int, signal: Any = None) -> None:
        runtime = BatchTask.runtime
        if runtime is None or runtime.feeder is None:
            return
        cancelled = runtime.feeder.cancel_all()
        if cancelled:
            log.warning("terminating: %d running batches checkpointed and handed back", cancelled)


def _handed_back(exc: Exception) -> ExceptionInfo:
    """An `ExceptionInfo` of a requeueing `Reject` caused by `exc`, as `on_failure` takes."""
    try:
        raise Reject(f"ended outside its body: {exc!r}", requeue=True) from exc
    except Reject:
        return ExceptionInfo()


class BatchRequest(HeldRequest):
    """A generate_batch request whose terminate stops its own batch, not the worker's others.

    Every task of a threads pool shares the worker's pid, so the pool's `terminate_job(pid)`
    cannot tell one task from another; the request knows its order. The batch checkpoints
    what finished, ends in BatchTerminated, and the task parks it in the failed set (an
    operator stopped it on purpose: `genfleet retry` resends it). A request not started yet
    is only marked revoked, which Celery checks before it runs.
    """

    # A batch holds a prefetch slot on the new channel after a reconnect
    # (`workers.process.reconnect`).
    counts_against_prefetch = True

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        """Record whose delivery this is as it is received: until its admission claims it
        (after reading the store), nothing else says which worker holds the order, and the
        reaper could not give it back if this worker died first (workers/observe/liveness.py). Best
        effort: without the record, an unclaimed order is given back after half a lease."""
        super().__init__(*args, **kwargs)
        runtime = BatchTask.runtime
        tag = getattr(self.message, "delivery_tag", None)
        if runtime is not None and tag is not None:
            try:
                Ledger(runtime.lease_redis).delivered(
                    str(tag), runtime.hostname, runtime.presence_name
                )
            except redis.RedisError as exc:
                log.warning("delivery of %s not recorded (%s)", self.id, exc)

    def terminate(self, pool: Any, signal: Any = None) -> None:
        order = (self.kwargs or {}).get("order") or {}
        runtime = BatchTask.runtime
        if not self.time_start or runtime is None or runtime.feeder is None:
            return
        run, batch = str(order.get("run")), str(order.get("batch"))
        if runtime.feeder.cancel_batch(run, batch):
            log.warning("terminate of %s: batch %s/%s cancelled", self.id, run, batch)
        self._announce_revoked("terminated", True, signal, False)
