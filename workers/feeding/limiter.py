"""The in-flight limiter: how many requests one worker has in its engine at once.

One per worker (`feeding.feeder.Feeder`), shared by every batch the worker runs, so the next
batch's prompts fill the engine while the last one's stragglers finish; it halves under
backpressure and grows back one slot a completion.
"""

from __future__ import annotations

import asyncio
from collections import deque


class InflightLimiter:
    """FIFO slots for requests in flight, at most `size` at once (all on one event loop).

    Backpressure halves `size` (at most once per `shrink_spacing_s`, so one burst of 429s
    counts once); after `recover_s` without backpressure each completion gives one slot
    back, up to `max_size`. `now` is a parameter so the rule is tested without a clock.

        limiter = InflightLimiter(320)
        async with limiter: ...          # one request
        limiter.shrink(now)              # a 429: 160 slots for a while
        limiter.completed(now)           # recover_s later: 161, 162, ... back to 320
    """

    def __init__(
        self, max_size: int, *, recover_s: float = 10.0, shrink_spacing_s: float = 1.0
    ) -> None:
        self.max_size = max_size
        self.size = max_size
        self.held = 0
        self.recover_s = recover_s
        self.shrink_spacing_s = shrink_spacing_s
        self.shrunk_at = -float("inf")
        self._waiters: deque[asyncio.Future[None]] = deque()

    async def acquire(self) -> None:
        if self.held < self.size and not self._waiters:
            self.held += 1
            return
        waiter: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._waiters.append(waiter)
        try:
            await waiter
        except asyncio.CancelledError:
            if waiter.done() and not waiter.cancelled():
                self.release()  # the slot was granted as the task was cancelled
            else:
                self._waiters.remove(waiter)
            raise

    def release(self) -> None:
        self.held -= 1
        self._wake()

    def _wake(self) -> None:
        while self._waiters and self.held < self.size:
            waiter = self._waiters.popleft()
            if not waiter.done():
                self.held += 1
                waiter.set_result(None)

    def shrink(self, now: float) -> None:
        """The engine pushed back: halve the slots (never below one)."""
        if now - self.shrunk_at < self.shrink_spacing_s:
            return
        self.shrunk_at = now
        self.size = max(1, self.size // 2)

    def completed(self, now: float) -> None:
        """A request finished: once the engine has stopped pushing back, grow by one slot."""
        if self.size < self.max_size and now - self.shrunk_at >= self.recover_s:
            self.size += 1
            self._wake()

    async def __aenter__(self) -> None:
        if self.held < self.size and not self._waiters:  # the common case, without a coroutine
            self.held += 1
            return
        await self.acquire()

    async def __aexit__(self, *exc: object) -> None:
        self.release()
