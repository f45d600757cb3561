"""Celery's threads pool, able to stop running batches when Celery asks it to.

Threads cannot be killed, and Celery's own threads pool answers a request to terminate a job
(a cold shutdown: SIGQUIT or a second Ctrl-C) with NotImplementedError, after which
the worker hangs. Here terminating means cancelling the worker's running batches: each one
checkpoints what finished and hands its batch back to the queue, so the stop completes and
nothing is lost.

Terminating one task (Flower's "terminate", `revoke(task_id, terminate=True)`) goes through
`BatchRequest.terminate` instead, which cancels that task's batch only.

`ChildWorkers` is the other pool here: one worker process per GPU group (`worker --gpus
0,1,2,3 --tp-size 2`), restarted when one dies unasked, within a budget.
"""

from __future__ import annotations

import logging
import subprocess
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import redis
from celery.concurrency.thread import TaskPool as ThreadTaskPool

from genfleet.common.backoff import Backoff
from genfleet.common.ledger import Ledger
from genfleet.workers.context import BatchTask
from genfleet.workers.reconnect import HeldRequest

log = logging.getLogger("genfleet.worker")


# Threads per batch slot. A batch whose prompts are all in the engine hands its slot to the
# next batch (the worker's runtime raises the prefetch count while only its stragglers run),
# so the pool needs threads beyond `worker_concurrency` for those batches to finish on.
THREADS_PER_SLOT = 4


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

    def terminate_job(self, pid: int, signal: Any = None) -> None:
        runtime = BatchTask.runtime
        if runtime is None or runtime.feeder is None:
            return
        cancelled = runtime.feeder.cancel_all()
        if cancelled:
            log.warning("terminating: %d running batches checkpointed and handed back", cancelled)


class BatchRequest(HeldRequest):
    """A generate_batch request whose terminate stops its own batch, not the worker's others.

    Every task of a threads pool shares the worker's pid, so the pool's `terminate_job(pid)`
    cannot tell one task from another; the request knows its order. The batch checkpoints
    what finished, ends in BatchTerminated, and the task parks it in the failed set (an
    operator stopped it on purpose: `genfleet retry` resends it). A request not started yet
    is only marked revoked, which Celery checks before it runs.
    """

    # A batch holds a prefetch slot on the new channel after a reconnect (`workers.reconnect`).
    counts_against_prefetch = True

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        """Record whose delivery this is as it is received: until its admission claims it
        (after reading the store), nothing else says which worker holds the order, and the
        reaper could not give it back if this worker died first (workers/liveness.py). Best
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


def restart_delay_s(
    code: int, restarts: int, budget: int, stopping: bool, backoff_s: float
) -> float | None:
    """Seconds to wait before restarting a child worker that exited with `code`, or None to
    let it go: a stop was asked for, it exited cleanly (0), or its budget is spent.

    >>> restart_delay_s(-9, 0, 5, False, 2.0), restart_delay_s(-9, 5, 5, False, 2.0)
    (2.0, None)
    """
    if stopping or code == 0 or restarts >= budget:
        return None
    return Backoff(base_s=backoff_s).delay_s(restarts)


@dataclass
class Child:
    argv: list[str]
    env: dict[str, str]
    label: str
    proc: subprocess.Popen[bytes] | None = None
    restarts: int = 0
    due_at: float | None = None  # when a restart is due
    code: int | None = None  # the final exit code, once it is let go
    last_code: int = 0  # how it last exited


class ChildWorkers:
    """Start every child, watch them, restart the ones that die unasked; `run()` returns the
    highest final exit code once every child is let go. `report` is told of each restart."""

    def __init__(
        self,
        children: list[Child],
        budget: int,
        backoff_s: float,
        report: Callable[[Child, int], None] | None = None,
        poll_s: float = 0.5,
    ) -> None:
        self.children = children
        self.budget = budget
        self.backoff_s = backoff_s
        self.report = report
        self.poll_s = poll_s
        self.stopping = False

    def signal(self, signum: int) -> None:
        """Forward a signal to every live child; a stop is not a death to restart."""
        self.stopping = True
        for child in self.children:
            if child.proc is not None and child.proc.poll() is None:
                child.proc.send_signal(signum)

    def _start(self, child: Child) -> None:
        child.proc = subprocess.Popen(child.argv, env=child.env)
        child.due_at = None

    def _check(self, child: Child, now: float) -> None:
        if child.code is not None:
            return
        if child.due_at is not None:
            if self.stopping:
                child.code = child.last_code
            elif now >= child.due_at:
                self._start(child)
            return
        assert child.proc is not None
        code = child.proc.poll()
        if code is None:
            return
        delay = restart_delay_s(code, child.restarts, self.budget, self.stopping, self.backoff_s)
        if delay is None:
            if code and not self.stopping:
                log.error("%s exited with code %d; restart budget spent", child.label, code)
            child.code = code
            return
        child.restarts += 1
        child.last_code = code
        log.error(
            "%s exited with code %d: restarting it in %.1f s (%d of %d)",
            child.label,
            code,
            delay,
            child.restarts,
            self.budget,
        )
        if self.report is not None:
            self.report(child, code)
        child.due_at = now + delay

    def run(self) -> int:
        for child in self.children:
            self._start(child)
        while any(child.code is None for child in self.children):
            for child in self.children:
                self._check(child, time.monotonic())
            time.sleep(self.poll_s)
        return max(child.code or 0 for child in self.children)


def report_restart(settings: Any, child: Child, code: int) -> None:
    """A `worker_restarted` finding in the findings stream (and `genfleet findings`)."""
    import orjson
    import redis

    from genfleet.common import keys
    from genfleet.common.redis_conn import connect

    finding = {
        "worker": child.label,
        "gpu_uuid": None,
        "verdict": "unresponsive",
        "cause": "worker_restarted",
        "numbers": {"exit_code": code, "restarts": child.restarts},
        "suggestion": "a child worker died and was restarted: read its log for the cause",
        "ts": time.time(),
        "run": None,
    }
    try:
        client = connect(settings, check=False, timeout_s=5.0)
        client.xadd(
            keys.findings_key(),
            {"finding": orjson.dumps(finding)},
            maxlen=settings.findings_maxlen,
            approximate=True,
        )
        client.close()
    except redis.RedisError as exc:
        log.warning("could not record the restart of %s: %s", child.label, exc)
