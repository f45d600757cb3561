"""The suspect lane: the way back into the engine for prompts that were arriving when it died.

One per worker (`feeding.feeder.Feeder`); the feeder decides who is a suspect and who is to
blame, the lane only who may enter the engine when.
"""

from __future__ import annotations

import asyncio
import heapq
import itertools


class SuspectLane:
    """Prompts that were arriving when the engine died (no output yet) go back through here.

    Most of them are innocent, so the lane opens step by step: one suspect at a time, twice
    as many after each one that succeeds or survives its arrival (still in the engine
    `feeder.SUSPECT_PROBE_S` after it was sent, the engine alive: a prompt that kills the engine
    does so as it arrives), one again after a death. Waiting for completions instead kept the
    engine nearly empty for as long as a few completions take — minutes for long thinking
    ones — after every restart. A prompt in flight at two deaths goes alone (`solo`: no
    other suspect enters until it survived its arrival or ended), first; while it does,
    `calm` is clear and no fresh prompt is sent either (`Feeder._slot`), so that a crash in
    its arrival is its own, not a fresh poison's beside it. Suspects are ranked by deaths
    seen, then by how late they were sent before the death (a prompt that kills the engine
    on arrival is the last one sent). All on the feeder's loop.

        lane = SuspectLane()
        await lane.enter((-deaths, -sent_at), solo=deaths >= 2)
        lane.survived(exclusive=deaths >= 2)  # it outlived its arrival: the lane widens
        lane.leave(ok=True, exclusive=False)  # it succeeded: the lane widens
        lane.died()                           # the engine died: one at a time again
    """

    MAX_WIDTH = 64

    def __init__(self) -> None:
        self.width = 1
        self.held = 0
        self.solo = False  # a solo suspect is in the engine: nobody else enters
        self.calm = asyncio.Event()  # set while no solo holds the lane: fresh prompts may go
        self.calm.set()
        self._order = itertools.count()
        self._waiting: list[tuple[tuple[float, float], int, bool, asyncio.Future[None]]] = []

    def _grantable(self, solo: bool) -> bool:
        if self.solo:
            return False
        return self.held == 0 if solo else self.held < self.width

    def _grant(self, solo: bool) -> None:
        self.held += 1
        self.solo = solo
        if solo:
            self.calm.clear()

    def _unsolo(self) -> None:
        self.solo = False
        self.calm.set()

    async def enter(self, rank: tuple[float, float], solo: bool) -> None:
        """Wait for this suspect's turn. Whether it is alone is read at a death (`held`), not
        at entry: one that entered alone may be joined later."""
        if not self._waiting and self._grantable(solo):
            self._grant(solo)
            return
        turn: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        heapq.heappush(self._waiting, (rank, next(self._order), solo, turn))
        try:
            await turn
        except asyncio.CancelledError:
            if turn.done() and not turn.cancelled():
                self.leave(ok=False, exclusive=solo)  # granted as it was cancelled
            raise

    def leave(self, ok: bool, exclusive: bool = True) -> None:
        """A suspect is out of the engine (`ok`: it succeeded); `exclusive`: it still held the
        lane alone as a solo (not yet released by `survived`)."""
        self.held -= 1
        if exclusive:
            self._unsolo()
        if ok:
            self.width = min(self.width * 2, self.MAX_WIDTH)
        self._wake()

    def survived(self, exclusive: bool) -> None:
        """A suspect outlived its arrival in the engine: widen as a success would, and a solo
        lets the next suspects in (its slot stays held until it ends)."""
        if exclusive:
            self._unsolo()
        self.width = min(self.width * 2, self.MAX_WIDTH)
        self._wake()

    def died(self) -> None:
        self.width = 1

    def _wake(self) -> None:
        while self._waiting:
            _rank, _n, solo, turn = self._waiting[0]
            if turn.done():
                heapq.heappop(self._waiting)
                continue
            if not self._grantable(solo):
                return
            heapq.heappop(self._waiting)
            self._grant(solo)
            turn.set_result(None)
