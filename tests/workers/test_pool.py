"""The worker's threads pool: an error raised around a task's body hands its message back.

Celery's own threads pool drops `error_callback`: an error outside the task's body (its
STARTED state or its failure written to a result backend that is away) ended in a future
nobody read, and the request stayed active for good, its message neither acked nor handed
back (`tests/faults/test_fault_blip.py` saw a worker take nothing more after a Redis blip).
"""

from __future__ import annotations

from typing import Any

import pytest
import redis
from billiard.einfo import ExceptionWithTraceback
from celery.exceptions import Reject

from genfleet.workers.process.pool import TaskPool


class Calls:
    def __init__(self) -> None:
        self.success: list[Any] = []
        self.failure: list[Any] = []
        self.ran = 0

    def target(self, fail: bool) -> str:
        self.ran += 1
        if fail:
            raise redis.ConnectionError("Error 111 connecting to 127.0.0.1:6379")
        return "done"


def accept_failing(pid: int, time_accepted: float) -> None:
    raise redis.ConnectionError("the task-started event was not sent")


def accept_ok(pid: int, time_accepted: float) -> None:
    return None


@pytest.mark.parametrize(
    ("fail", "accept", "outcome", "ran"),
    [
        (False, accept_ok, "success", 1),  # the task's own result: its callback
        (True, accept_ok, "handed back", 1),  # the tracer raised (a backend that is away)
        (False, accept_failing, "handed back", 0),  # it never started
    ],
)
def test_an_error_around_a_task_hands_its_message_back(
    fail: bool, accept: Any, outcome: str, ran: int
) -> None:
    calls = Calls()
    pool = TaskPool(limit=1)
    try:
        pool.on_apply(
            calls.target,
            (fail,),
            {},
            callback=calls.success.append,
            accept_callback=accept,
            error_callback=calls.failure.append,
        ).wait(10)
    finally:
        pool.executor.shutdown(wait=True)
    assert calls.ran == ran
    if outcome == "success":
        assert (calls.success, calls.failure) == (["done"], [])
        return
    assert calls.success == []
    [info] = calls.failure
    exc = info.exception  # billiard wraps it; Celery's on_failure unwraps it so
    exc = exc.exc if isinstance(exc, ExceptionWithTraceback) else exc
    assert isinstance(exc, Reject) and exc.requeue is True
    assert isinstance(exc.__cause__, redis.ConnectionError)
