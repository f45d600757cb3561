"""genfleet's error tree. Foreign errors (botocore, redis, httpx, NVML) are mapped at their seam.

GenfleetError
├── ConfigError            bad settings or arguments: fix and run again
├── InputError             a dataset cannot be read at all (every line rejected, no file)
├── RunMismatch            a run exists with other prompts, parameters or model: never merged
├── StoreError             the object store failed after its own retries
│   └── StoreUnavailable   cannot reach it now: retry later, nothing is lost
├── BrokerUnavailable      Redis does not answer: a hint says how to start one
├── EngineError            the engine cannot serve
│   ├── PreflightError     the checkpoint or command would not run (before any GPU time)
│   ├── EngineStartError   it did not become ready; carries the last log lines
│   ├── EngineDown         it died or stopped answering: retryable
│   └── RestartBudgetExhausted  it kept dying: the worker stops taking work
└── RequestRejected        the engine refused one prompt (HTTP 400): an error record
"""

from __future__ import annotations


class GenfleetError(Exception):
    """Base of every error genfleet raises on purpose."""


class ConfigError(GenfleetError):
    pass


class InputError(GenfleetError):
    pass


class RunMismatch(GenfleetError):
    """Enqueueing into a run that exists, with anything different: refused before touching the
    store or the queue; the message names each difference and what to do."""


class StoreError(GenfleetError):
    pass


class StoreUnavailable(StoreError):
    pass


class BrokerUnavailable(GenfleetError):
    pass


class EngineError(GenfleetError):
    pass


class PreflightError(EngineError):
    pass


class EngineStartError(EngineError):
    def __init__(self, message: str, log_tail: list[str] | None = None) -> None:
        self.log_tail = log_tail or []
        tail = "\n".join(f"  | {line}" for line in self.log_tail[-30:])
        super().__init__(f"{message}\nlast engine log lines:\n{tail}" if tail else message)


class EngineDown(EngineError):
    pass


class RestartBudgetExhausted(EngineError):
    pass


class RequestRejected(GenfleetError):
    """The engine answered 400 for one prompt: permanent for that prompt, not for the batch."""

    def __init__(self, status: int, kind: str, message: str) -> None:
        self.status = status
        self.kind = kind
        super().__init__(message)
