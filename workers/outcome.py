"""What a batch's failed try means, decided once, as data.

`outcome()` is a pure function of the error, the tries counted so far and the retry budget;
`workers.tasks.generate_batch` applies what it returns in one place (as dramatiq's Retries
middleware applies one `compute_backoff`). A table test covers every row:

| error                                  | action    | what follows                          |
|----------------------------------------|-----------|---------------------------------------|
| BatchCancelled (run cancelled)         | park      | acked, not failed; a resume resends   |
| BatchSuperseded (staging replaced)     | drop      | acked, nothing written; the batch's   |
|                                        |           | state is the new staging's: untouched |
| BatchInputMissing (staged input gone;  | fail      | failed set at once: no try can help   |
|   BatchInputMismatch: not the order's) |           |                                       |
| EngineConfigError (401/403/404)        | hand_back | back to the queue untouched, no try   |
|                                        |           | spent; this worker stops consuming    |
| BatchTerminated (operator's revoke)    | fail      | failed set; `genfleet retry` resends  |
| BatchInterrupted (worker shutting down)| requeue   | back to the queue: not a try          |
| retryable (engine, store, Redis), tries| retry     | after `BATCH_RETRY`'s backoff         |
|   within `batch_retries`               |           |                                       |
| retryable, tries spent                 | fail      | failed set, with the last error       |
| anything else (unforeseen)             | fail      | failed set, logged with its traceback |

Unforeseen means permanent until someone looks: parked in the failed set, where `status` shows
it and `genfleet retry` re-runs it, rather than left with a running entry whose lease is gone,
which the reaper would re-enqueue forever.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import redis

from genfleet.common.backoff import BATCH_RETRY, Backoff
from genfleet.common.errors import (
    BatchCancelled,
    BatchInputMissing,
    BatchInterrupted,
    BatchSuperseded,
    BatchTerminated,
    EngineConfigError,
    EngineError,
    StoreError,
)

Action = Literal["park", "drop", "hand_back", "requeue", "retry", "fail"]

# Errors a later try can get past: the engine restarting, the store or Redis unreachable.
RETRYABLE = (EngineError, StoreError, redis.RedisError, ConnectionError, TimeoutError)
# Among those, the ones no try can get past, or that are no batch's fault.
_NOT_A_TRY = (BatchInputMissing, EngineConfigError)


@dataclass(frozen=True)
class Outcome:
    """What the task does with a failed try.

    `failed_reason` is what the failed set records (action "fail"), `message` what the
    task's error says; `delay_s` is the backoff a retry waits first; `unforeseen` asks for
    the traceback in the log."""

    action: Action
    message: str
    failed_reason: str = ""
    delay_s: float = 0.0
    unforeseen: bool = False


def counts_a_try(exc: BaseException) -> bool:
    """Whether this failure spends one of the batch's tries (counted before `outcome`)."""
    return isinstance(exc, RETRYABLE) and not isinstance(exc, _NOT_A_TRY)


def outcome(
    exc: BaseException,
    name: str,
    attempts: int,
    batch_retries: int,
    backoff: Backoff = BATCH_RETRY,
) -> Outcome:
    """What to do after the try of batch `name` ("run/batch") failed with `exc`; `attempts`
    is the tries counted so far, this one included (0 when it does not count a try)."""
    described = f"{type(exc).__name__}: {exc}"
    if isinstance(exc, BatchCancelled):
        return Outcome("park", str(exc))
    if isinstance(exc, BatchSuperseded):
        return Outcome("drop", str(exc))
    if isinstance(exc, BatchInputMissing):
        return Outcome("fail", str(exc), described)
    if isinstance(exc, EngineConfigError):
        return Outcome("hand_back", str(exc))
    if isinstance(exc, BatchTerminated):
        # Recorded under its base name, as `status` has always shown a termination.
        return Outcome("fail", str(exc), f"{BatchInterrupted.__name__}: {exc}")
    if isinstance(exc, BatchInterrupted):
        return Outcome("requeue", str(exc))
    if isinstance(exc, RETRYABLE):
        if attempts > batch_retries:
            return Outcome("fail", f"{name} failed {attempts} times: {exc}", described)
        message = f"{name} try {attempts} failed: {exc}"
        return Outcome("retry", message, delay_s=backoff.delay_s(attempts))
    return Outcome("fail", f"{name}: {described}", described, unforeseen=True)
