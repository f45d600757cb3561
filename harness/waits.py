"""Waiting on a condition with a deadline, never a fixed sleep."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any


def wait_for(
    condition: Callable[[], Any], timeout_s: float, what: str, interval_s: float = 0.1
) -> Any:
    """Poll `condition` until it returns a truthy value; fail naming `what` at the deadline."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = condition()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s:.0f} s waiting for {what}")
        time.sleep(interval_s)


def meanwhile(
    ready: Callable[[], Any], action: Callable[[], None], what: str
) -> Callable[[], None]:
    """Run `action` on a thread of its own once `ready()` holds (10 s at most, `what` names
    it); returns the join, which re-raises what the thread raised."""
    raised: list[BaseException] = []

    def run() -> None:
        try:
            wait_for(ready, 10, what, 0.01)
            action()
        except BaseException as exc:  # handed to the test's own thread by join()
            raised.append(exc)

    thread = threading.Thread(target=run, name="meanwhile")
    thread.start()

    def join() -> None:
        thread.join(timeout=10)
        if raised:
            raise raised[0]

    return join
