"""Prefetch slots handed on: a batch whose prompts are all in the engine lets Celery fetch one
more, so that the engine never waits for one batch's stragglers.

Without this, a worker whose `worker_concurrency` batches all wait on their longest prompt
takes nothing new and its engine drains. The feeder says when every prompt of a batch is in
the engine (`batch_sent`, on its loop); the task says when the batch is over (`batch_ended`),
and the slot it handed on is taken back. Bounded by the pool's spare threads
(`workers.process.pool`).

A slot is handed on only while the engine has room (`room`: the prompts in flight and waiting
are fewer than its cap); a batch sent while it is full waits, and each answer that leaves the
engine offers the waiting slots again (`offer`). One slot at a time: the next goes on once the
batch it fetched is in the feeder (`arrived`), its prompts counted in the room, or after
`TRANSIT_S` (the queue was empty). So a worker holds about what its engine runs, not every
order it could take: with stragglers only, it takes the next batches; full, it leaves the
orders in the queue to a worker with room (the last orders of a run go to both engines, not
all to the one that asked first).

A reconnect to the broker gives the consumer a new prefetch count, at its initial value, while
the batches that handed their slot on still run and count as delivered on the new channel
(`workers.process.reconnect`): the slots they handed on are counted on the new one too
(`count_on`), or the worker would take nothing until all of them, stragglers included, ended.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

# How long a slot handed on for room may wait for its batch to reach the feeder before the
# next one goes on: longer than a fetch and an admission (the batch's parts read from the
# store); past it, the queue had nothing to give.
TRANSIT_S = 2.0


def has_room(inflight: int, waiting: int, cap: int | None) -> bool:
    """Whether an engine running at most `cap` requests would run more than the worker
    holds: `inflight` requests in it, `waiting` prompts not sent yet. No known cap: always.

    >>> has_room(250, 5, 256), has_room(250, 6, 256), has_room(900, 0, None)
    (True, False, True)
    """
    return cap is None or inflight + waiting < cap


def _nothing() -> None:
    """What the woken event loop runs: nothing (it updates the prefetch count first)."""


class PrefetchSlots:
    """The worker's prefetch count, raised by one for each batch that has only stragglers
    left; `celery_worker()` is the WorkController once the engine step has set it."""

    def __init__(
        self,
        celery_worker: Callable[[], Any],
        room: Callable[[], bool] = lambda: True,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        """`room()`: whether the engine would run more than the worker holds now (read on
        the feeder's loop and the tasks' threads; plain counters, no lock of its own)."""
        self.celery_worker = celery_worker
        self.room = room
        self.clock = clock
        self._transit_at: float | None = None  # a slot handed on, its batch not arrived
        self._lock = threading.Lock()
        self._released = 0
        self._released_by: set[tuple[str, str]] = set()  # batches whose slot was handed on
        # Batches sent while the engine was full, in order: their slot goes on once it has room.
        self._sent: dict[tuple[str, str], None] = {}
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
        with self._lock:
            released = self._release()
        if released:
            self._wake()
        return released

    def _release(self) -> bool:
        """`release` with the lock held."""
        spare = int(getattr(getattr(self.celery_worker(), "pool", None), "spare_threads", 0) or 0)
        qos = self._qos()
        if qos is None or self._released >= spare:
            return False
        self._released += 1
        qos.increment_eventually(1)
        return True

    def _wake(self) -> None:
        """Wake the consumer's event loop, so that it applies the raised count (and fetches
        the next batch) now, not at its next timer tick, up to a second later: a worker whose
        batches all hand their slots on at once would take the next ones a few a second."""
        hub = getattr(self.celery_worker(), "hub", None)
        if hub is not None:
            hub.call_soon(_nothing)

    def batch_sent(self, run: str, batch: str) -> None:
        """Every prompt of the batch is in the engine: its slot goes on, now or once the
        engine has room."""
        with self._lock:
            self._sent[(run, batch)] = None
        self.offer()

    def offer(self) -> None:
        """Hand on the slot of the first sent batch if the engine has room, a spare thread
        is left and no slot handed on is still waiting for its batch (called as a batch is
        sent or arrives and as each answer leaves the engine)."""
        with self._lock:
            now = self.clock()
            if self._transit_at is not None and now - self._transit_at < TRANSIT_S:
                return
            if not (self._sent and self.room() and self._release()):
                return
            name = next(iter(self._sent))
            del self._sent[name]
            self._released_by.add(name)
            self._transit_at = now
        self._wake()

    def arrived(self) -> None:
        """A batch reached the feeder, its prompts counted in the room: the next slot may go."""
        with self._lock:
            self._transit_at = None
        self.offer()

    def batch_ended(self, run: str, batch: str) -> None:
        """The batch's task is over: the slot it handed on, if it did, is taken back."""
        with self._lock:
            self._sent.pop((run, batch), None)
            released = (run, batch) in self._released_by
            self._released_by.discard((run, batch))
        if released:
            self.restore()
        self.offer()  # a spare thread, and the room its answers left, for a waiting slot

    def restore(self) -> None:
        """Take one handed-on slot back."""
        with self._lock:
            qos = self._qos()
            self._released -= 1
            if qos is not None:
                qos.decrement_eventually(1)
