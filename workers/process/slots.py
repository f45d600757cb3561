"""Prefetch slots handed on: a batch whose prompts are all in the engine lets Celery fetch one
more, so that the engine never waits for one batch's stragglers.

Without this, a worker whose `worker_concurrency` batches all wait on their longest prompt
takes nothing new and its engine drains. The feeder says when every prompt of a batch is in
the engine (`batch_sent`, on its loop); the task says when the batch is over (`batch_ended`),
and the slot it handed on is taken back. Bounded by the pool's spare threads
(`workers.process.pool`).

A slot is handed on only while the engine has room (`room`: how many fewer prompts the worker
holds than its engine's cap, `room_left`); a batch sent while it is full waits, and each
prompt that leaves the worker offers the waiting slots again (`offer`). As many slots go on
at once as the room holds batches of the size the last ones brought (`arrived`: a batch
handed back after a fault brings only its unfinished prompts), one before any has arrived; a
slot whose batch has not arrived counts in the room until it does, or for `TRANSIT_S` (the
queue was empty). So a worker holds about what its engine runs, not every order it could take: with
stragglers only, it takes the next batches; full, it leaves the orders in the queue to a
worker with room (the last orders of a run go to both engines, not all to the one that asked
first); a new worker fills its engine with a run's handed-back batches in a few fetches, not
one at a time.

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


# The room of an engine whose cap is not known: always some, for one batch at a time.
UNKNOWN_ROOM = 1


def room_left(held: int, cap: int | None) -> int:
    """How many more prompts an engine running at most `cap` requests would run than the
    worker holds (`held`: its batches' prompts with no record yet, in the engine, waiting to
    be sent or to be sent again once a restarting engine is back); 0: none.

    >>> room_left(255, 256), room_left(256, 256), room_left(900, None)
    (1, 0, 1)
    """
    return UNKNOWN_ROOM if cap is None else max(cap - held, 0)


def batches_in(room: int, in_transit: int, batch_prompts: float | None) -> bool:
    """Whether one more slot may go on: the room left once the batches already fetched
    (`in_transit`, not arrived) are in, each the size of the last ones (`batch_prompts`;
    None before any arrived: one slot at a time).

    >>> batches_in(100, 0, None), batches_in(100, 1, None), batches_in(100, 3, 25.0)
    (True, False, True)
    >>> batches_in(100, 4, 25.0), batches_in(0, 0, 25.0), batches_in(10, 1, 2.0)
    (False, False, True)
    """
    if room <= 0:
        return False
    if batch_prompts is None:
        return in_transit == 0
    return room - in_transit * batch_prompts > 0


def _nothing() -> None:
    """What the woken event loop runs: nothing (it updates the prefetch count first)."""


class PrefetchSlots:
    """The worker's prefetch count, raised by one for each batch that has only stragglers
    left; `celery_worker()` is the WorkController once the engine step has set it."""

    def __init__(
        self,
        celery_worker: Callable[[], Any],
        room: Callable[[], int] = lambda: UNKNOWN_ROOM,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        """`room()`: how many more prompts the engine would run than the worker holds now
        (`room_left`; read on the feeder's loop and the tasks' threads: plain counters, no
        lock of its own)."""
        self.celery_worker = celery_worker
        self.room = room
        self.clock = clock
        self._transit: list[float] = []  # when each slot handed on, its batch not arrived, went
        self._batch_prompts: float | None = None  # what the last batches brought (a mean)
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
        """Hand on the slots of the first sent batches while the engine has room for them
        beside the batches fetched and not arrived (`batches_in`) and spare threads are left
        (called as a batch is sent or arrives and as each answer leaves the engine)."""
        handed = False
        with self._lock:
            now = self.clock()
            self._transit = [at for at in self._transit if now - at < TRANSIT_S]
            while (
                self._sent
                and batches_in(self.room(), len(self._transit), self._batch_prompts)
                and self._release()
            ):
                name = next(iter(self._sent))
                del self._sent[name]
                self._released_by.add(name)
                self._transit.append(now)
                handed = True
        if handed:
            self._wake()

    def arrived(self, prompts: int) -> None:
        """A batch of `prompts` reached the feeder, counted in the room: the slot that fetched
        it is no longer in transit, and the next slots go on by the size of the last batches
        (a mean that weighs the newest half)."""
        with self._lock:
            if self._transit:
                self._transit.pop(0)
            last = self._batch_prompts
            self._batch_prompts = float(prompts) if last is None else (last + prompts) / 2
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
