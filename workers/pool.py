"""Celery's threads pool, able to stop running batches when Celery asks it to.

Threads cannot be killed, and Celery's own threads pool answers a request to terminate a job
(a cold shutdown: SIGQUIT or a second Ctrl-C; a lost broker connection with
`worker_cancel_long_running_tasks_on_connection_loss`) with NotImplementedError, after which
the worker hangs. Here terminating means cancelling the worker's running batches: each one
checkpoints what finished and hands its batch back to the queue, so the stop completes and
nothing is lost.
"""

from __future__ import annotations

import logging
from typing import Any

from celery.concurrency.thread import TaskPool as ThreadTaskPool

log = logging.getLogger("genfleet.worker")


class TaskPool(ThreadTaskPool):  # type: ignore[misc]
    def terminate_job(self, pid: int, signal: Any = None) -> None:
        from genfleet.workers import runtime

        current = runtime._current
        if current is None or current.feeder is None:
            return
        cancelled = current.feeder.cancel_all()
        if cancelled:
            log.warning("terminating: %d running batches checkpointed and handed back", cancelled)
