"""Running batches handed back to the queue while this worker's engine restarts.

An engine that dies (a crash, the watchdog's kill of a stalled one) holds its worker's answers
in flight until it is back: minutes for a 27B model's weights and CUDA graphs. While orders
wait in the queue every worker is full and nothing is gained by moving them; once none wait
(the run's last batches, a fleet larger than its work) another worker's engine has room, and
they finish there from their ids instead. A move is not free: each batch is read from the
store again by a worker that fetches a few at a time, and each answer prefills what it drew;
seconds, so an engine whose last start took less than `hand_back_min_start_s` (the emulator's
second, a small model's) keeps its batches. So when such an engine dies with no order
waiting, the worker stops taking orders and hands its running batches back (each at its next
tick, once every prompt the death cut is judged: its evidence moves with the batch); once
the engine serves again it takes orders again, whatever is still queued.

One writer: the worker's engine hooks (`died`, `restarted`); the batches' threads read
`why()`.

    hand_back = HandBack(min_start_s=30.0)
    hand_back.died(orders_waiting=0, held=120, start_s=240.0)  # True: stop taking orders
    hand_back.why(engine_ready=False, settled=True)  # "its engine is restarting ..."
    hand_back.restarted()  # True: the worker takes orders again
"""

from __future__ import annotations

import threading


def hands_back(
    orders_waiting: int | None, held: int, start_s: float | None, min_start_s: float
) -> bool:
    """Whether an engine death sends the worker's running batches back to the queue: only
    while no order waits (every worker has room, or one will soon), the worker holds any
    prompt and the engine's last start (`start_s`, None: not known) took `min_start_s` or
    more; not when the queue could not be read (`None`: its batches stay, as they always
    did).

    >>> hands_back(0, 120, 240.0, 30.0), hands_back(3, 120, 240.0, 30.0)
    (True, False)
    >>> hands_back(0, 0, 240.0, 30.0), hands_back(None, 120, 240.0, 30.0)
    (False, False)
    >>> hands_back(0, 120, 2.0, 30.0), hands_back(0, 120, None, 30.0)
    (False, False)
    """
    long_start = start_s is not None and start_s >= min_start_s
    return orders_waiting == 0 and held > 0 and long_start


class HandBack:
    """Whether this worker's running batches go back to the queue now, and why."""

    def __init__(self, min_start_s: float) -> None:
        self.min_start_s = min_start_s
        self._lock = threading.Lock()
        self._why: str | None = None

    def died(self, orders_waiting: int | None, held: int, start_s: float | None) -> bool:
        """The engine died: hand back (True) as `hands_back` says; the caller then stops
        taking orders."""
        if not hands_back(orders_waiting, held, start_s, self.min_start_s):
            return False
        assert start_s is not None  # a long start, known
        with self._lock:
            self._why = (
                f"its engine is restarting (its last start took {start_s:.0f} s) and no "
                f"order waits: {held} prompts for a worker with room"
            )
        return True

    def restarted(self) -> bool:
        """The engine serves again: True when it was handing back (the caller takes orders
        again)."""
        with self._lock:
            was, self._why = self._why is not None, None
        return was

    def why(self, engine_ready: bool, settled: bool) -> str | None:
        """Why a running batch goes back now: while handing back, the engine not serving
        yet, and every prompt it cut judged (`Feeder.settled`); else None."""
        why = self._why
        if why is None or engine_ready or not settled:
            return None
        return why
