"""Prefetch slots handed on: a batch whose prompts are all in the engine lets Celery fetch one
more, so that the engine never waits for one batch's stragglers.

Without this, a worker whose `worker_concurrency` batches all wait on their longest prompt
takes nothing new and its engine drains. The feeder says when every prompt of a batch is in
the engine (`batch_sent`, on its loop); the task says when the batch is over (`batch_ended`),
and the slot it handed on is taken back. Bounded by the pool's spare threads
(`workers.process.pool`).

A reconnect to the broker gives the consumer a new prefetch count, at its initial value, while
the batches that handed their slot on still run and count as delivered on the new channel
(`workers.process.reconnect`): the slots they handed on are counted on the new one too
(`count_on`), or the worker would take nothing until all of them, stragglers included, ended.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any


def _nothing() -> None:
    """What the woken event loop runs: nothing (it updates the prefetch count first)."""


class PrefetchSlots:
    """The worker's prefetch count, raised by one for each batch that has only stragglers
    left; `celery_worker()` is the WorkController once the engine step has set it."""

    def __init__(self, celery_worker: Callable[[], Any]) -> None:
        self.celery_worker = celery_worker
        self._lock = threading.Lock()
        self._released = 0
        self._released_by: set[tuple[str, str]] = set()  # batches whose slot was handed on
        self._counted_on: Any = None  # the prefetch count the handed-on slots are counted on

    def count_on(self, qos: Any) -> None:
        """The consumer's prefetch count is `qos` (a new one after a reconnect, at its initial
        value): the slots handed on are added to it, once."""
        with self._lock:
            self._count_on(qos)

    def _count_on(self, qos: Any) -> None:
        if qos is not None and qos is not self._counted_on:
            self._counted_on = qos
            if self._released:
                qos.increment_eventually(self._released)

    def _qos(self) -> Any:
        """The consumer's prefetch count now (None before it starts), the slots handed on
        counted on it; called with the lock held."""
        qos = getattr(getattr(self.celery_worker(), "consumer", None), "qos", None)
        self._count_on(qos)
        return qos

    def release(self) -> bool:
        """Let Celery fetch one more batch (True when a slot was released)."""
        spare = int(getattr(getattr(self.celery_worker(), "pool", None), "spare_threads", 0) or 0)
        with self._lock:
            qos = self._qos()
            if qos is None or self._released >= spare:
                return False
            self._released += 1
            qos.increment_eventually(1)
        self._wake()
        return True

    def _wake(self) -> None:
        """Wake the consumer's event loop, so that it applies the raised count (and fetches
        the next batch) now, not at its next timer tick, up to a second later: a worker whose
        batches all hand their slots on at once would take the next ones a few a second."""
        hub = getattr(self.celery_worker(), "hub", None)
        if hub is not None:
            hub.call_soon(_nothing)

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
        with self._lock:
            qos = self._qos()
            self._released -= 1
            if qos is not None:
                qos.decrement_eventually(1)
