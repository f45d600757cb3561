"""What a failed try of a batch means: every row of `outcome`'s table, with no Redis, no
Celery and no clock (the task applies the row; test_core_tasks.py checks that end)."""

from __future__ import annotations

import pytest
import redis

from genfleet.common.backoff import BATCH_RETRY, Backoff
from genfleet.common.errors import (
    BatchCancelled,
    BatchHandedBack,
    BatchInputMismatch,
    BatchInputMissing,
    BatchInterrupted,
    BatchSuperseded,
    BatchTerminated,
    EngineConfigError,
    EngineDown,
    RestartBudgetExhausted,
    StoreUnavailable,
)
from genfleet.workers.outcome import counts_a_try, outcome

NAME = "r/batch-000007"


@pytest.mark.parametrize(
    ("exc", "attempts", "action", "failed_reason"),
    [
        (BatchCancelled("run cancelled"), 0, "park", ""),
        (BatchInputMissing("input gone"), 0, "fail", "BatchInputMissing: input gone"),
        (BatchInputMismatch("other prompts"), 0, "fail", "BatchInputMismatch: other prompts"),
        (BatchSuperseded("run staged anew"), 0, "drop", ""),
        (EngineConfigError("401 from the engine"), 0, "hand_back", ""),
        (BatchTerminated("r/b terminated by an operator"), 0, "fail", "BatchInterrupted: r/b"),
        (BatchInterrupted("shutting down"), 0, "requeue", ""),
        (BatchHandedBack("r/b handed back: its engine is restarting"), 0, "requeue", ""),
        (EngineDown("engine gone"), 1, "retry", ""),
        (EngineDown("engine gone"), 2, "retry", ""),
        (EngineDown("engine gone"), 3, "fail", "EngineDown: engine gone"),
        (RestartBudgetExhausted("kept dying"), 1, "retry", ""),
        (StoreUnavailable("s3 down"), 2, "retry", ""),
        (redis.ConnectionError("refused"), 1, "retry", ""),
        (ConnectionError("reset"), 3, "fail", "ConnectionError: reset"),
        (TimeoutError("slow"), 1, "retry", ""),
        (ValueError("bad gzip"), 0, "fail", "ValueError: bad gzip"),
        (KeyError("usage"), 0, "fail", "KeyError: 'usage'"),
    ],
)
def test_each_error_has_one_outcome(
    exc: Exception, attempts: int, action: str, failed_reason: str
) -> None:
    verdict = outcome(exc, NAME, attempts, batch_retries=2)
    assert verdict.action == action
    assert verdict.failed_reason.startswith(failed_reason)
    assert bool(verdict.failed_reason) == (action == "fail")
    assert verdict.unforeseen == isinstance(exc, (ValueError, KeyError))


@pytest.mark.parametrize(
    ("exc", "counts"),
    [
        (EngineDown("x"), True),
        (StoreUnavailable("x"), True),
        (redis.TimeoutError("x"), True),
        (TimeoutError("x"), True),
        (BatchInputMissing("x"), False),  # a StoreError no try gets past
        (EngineConfigError("x"), False),  # the worker's fault, not the batch's
        (BatchInterrupted("x"), False),
        (BatchHandedBack("x"), False),
        (BatchTerminated("x"), False),
        (BatchCancelled("x"), False),
        (ValueError("x"), False),
    ],
)
def test_only_retryable_failures_spend_a_try(exc: Exception, counts: bool) -> None:
    assert counts_a_try(exc) is counts


def test_a_retry_waits_the_batch_backoff_and_the_last_failure_says_how_many_tries() -> None:
    assert [outcome(EngineDown("x"), NAME, n, 9).delay_s for n in (1, 2, 6)] == [2.0, 4.0, 60.0]
    assert outcome(EngineDown("x"), NAME, 1, 5, Backoff(base_s=0.0)).delay_s == 0.0
    assert outcome(EngineDown("x"), NAME, 1, 5).delay_s == BATCH_RETRY.delay_s(1)
    assert outcome(EngineDown("gone"), NAME, 4, 3).message == f"{NAME} failed 4 times: gone"
    assert outcome(ValueError("bad"), NAME, 0, 3).message == f"{NAME}: ValueError: bad"
    assert outcome(BatchInputMissing("gone"), NAME, 0, 3).message == "gone"


def test_no_retries_means_the_first_retryable_failure_fails() -> None:
    assert outcome(EngineDown("x"), NAME, 1, batch_retries=0).action == "fail"
