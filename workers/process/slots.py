"""Prefetch slots handed on: a batch whose prompts are all in the engine lets Celery fetch one
more, so that the engine never waits for one batch's stragglers.

Without this, a worker whose `worker_concurrency` batches all wait on their longest prompt
takes nothing new and its engine drains. The feeder says when every prompt of a batch is in
the engine (`batch_sent`, on its loop); the task says when the batch is over (`batch_ended`),
and the slot it handed on is taken back. Bounded by the pool's spare threads
(`workers.process.pool`).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any


class PrefetchSlots:
    """The worker's prefetch count, raised by one for each batch that has only stragglers
    left; `celery_worker()` is the WorkController once the engine step has set it."""

    def __init__(self, celery_worker: Callable[[], Any]) -> None:
        self.celery_worker = celery_worker
        self._lock = threading.Lock()
        self._released = 0
        self._released_by: set[tuple[str, str]] = set()  # batches whose slot was handed on

    def _qos(self) -> Any:
        return getattr(getattr(self.celery_worker(), "consumer", None), "qos", None)

    def release(self) -> bool:
        """Let Celery fetch one more batch (True when a slot was released)."""
        qos = self._qos()
        spare = int(getattr(getattr(self.celery_worker(), "pool", None), "spare_threads", 0) or 0)
        if qos is None:
            return False
        with self._lock:
            if self._released >= spare:
                return False
            self._released += 1
        qos.increment_eventually(1)
        return True

    def batch_sent(self, run: str, batch: str) -> None:
        """Every prompt of the batch is in the engine: hand its slot on."""
        if self.release():
            with self._lock:
                self._released_by.add((run, batch))

    def batch_ended(self, run: str, batch: str) -> None:
        """The batch's task is over: the slot it handed on, if it did, is taken back."""
        with self._lock:
            released = (run, batch) in self._released_by
            self._released_by.discard((run, batch))
        if released:
            self.restore()

    def restore(self) -> None:
        """Take one handed-on slot back."""
        qos = self._qos()
        with self._lock:
            self._released -= 1
        if qos is not None:
            qos.decrement_eventually(1)
