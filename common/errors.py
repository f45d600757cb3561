"""genfleet's error tree. Foreign errors (botocore, redis, httpx, NVML) are mapped at their seam.

GenfleetError
├── ConfigError            bad settings or arguments: fix and run again
│   └── EngineConfigError  the engine refuses the worker (401/403/404): it stops consuming
├── InputError             a dataset cannot be read at all (every line rejected, no file)
├── RunMismatch            a run exists with other prompts, parameters or model: never merged
├── StoreError             the object store failed after its own retries
│   ├── StoreUnavailable   cannot reach it now: retry later, nothing is lost
│   ├── ManifestDamaged    a shard of a run's manifest is missing or not what its index says
│   └── BatchInputMissing  a batch's staged input is gone: retrying cannot help
│       └── BatchInputMismatch  it is not the content its order was issued for
├── BrokerUnavailable      Redis does not answer: a hint says how to start one
├── EngineError            the engine cannot serve
│   ├── PreflightError     the checkpoint or command would not run (before any GPU time)
│   ├── EngineStartError   it did not become ready; carries the last log lines
│   ├── EngineDown         it died or stopped answering: retryable
│   │   ├── EngineUnreachable  a request could not even connect: it was never in flight
│   │   └── RequestTimedOut  one request outlived its deadline: that prompt's error record
│   ├── EngineBusy         429 or "queue full": backpressure, wait and send again
│   └── RestartBudgetExhausted  its restart budget (a rate) is spent: no work for a cool-down
├── RequestRejected        the engine refused one prompt (HTTP 400): an error record
├── RequestFailed          one try of one prompt failed (abort, 5xx): retried, then an error record
└── BatchError             a batch stopped before its output (workers/outcome says what follows)
    ├── BatchInterrupted   the worker stops: checkpointed, the order goes back to the queue
    │   └── BatchTerminated  an operator terminated its task (revoke): in the failed set
    ├── BatchCancelled     its run was cancelled (`genfleet cancel`): checkpointed and parked
    ├── BatchSuperseded    its order is of a staging the run no longer has: dropped
    ├── ThinkingUnsupported  `--no-thinking` on a model with no switch: in the failed set
    └── BatchFailed        tries spent, or it cannot succeed: it is in the run's failed set
"""

from __future__ import annotations


class GenfleetError(Exception):
    """Base of every error genfleet raises on purpose."""


class ConfigError(GenfleetError):
    pass


class EngineConfigError(ConfigError):
    """The engine refused the worker itself (401, 403, 404): a wrong API key, URL or model
    name. Every prompt would fail the same way, so the worker stops consuming instead of
    spending batch retries."""


class InputError(GenfleetError):
    pass


class RunMismatch(GenfleetError):
    """Enqueueing into a run that exists, with anything different: refused before touching the
    store or the queue; the message names each difference and what to do."""


class StoreError(GenfleetError):
    pass


class StoreUnavailable(StoreError):
    pass


class ManifestDamaged(StoreError):
    """A shard of a run's manifest is missing, or its bytes are not those its index recorded
    (common/manifest.py): the run's batch list cannot be trusted, so nothing is read from it."""


class BatchInputMissing(StoreError):
    """The staged input object is gone: retrying cannot help."""


class BatchInputMismatch(BatchInputMissing):
    """The staged input is not the content the order names (`WorkOrder.input_sha256`):
    generating it would answer other prompts than the order's; retrying cannot help."""


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


class EngineUnreachable(EngineDown):
    """A request could not connect to the engine (refused, connect timeout): the engine
    never saw it, so whatever the engine died of, it was not this prompt."""


class AnswerInterrupted(EngineDown):
    """The connection broke after the answer had begun (output text streamed): the prompt's
    prefill and first steps had run, past the arrival where a prompt that crashes the engine
    does so, so whatever the engine died of, it was not this prompt."""


class RequestTimedOut(EngineDown):
    """One request outlived its own deadline (`workers/feeding/deadline`, from its max_tokens) while
    the engine answered connections: that prompt's failure, an error record, never its
    batch's. An EngineDown for whoever does not tell them apart."""


class EngineBusy(EngineError):
    """429, or 503 "The request queue is full.": the engine is up and asks the client to slow
    down. Never a prompt's failure; `retry_after_s` is the server's `Retry-After`, if any."""

    def __init__(self, message: str, retry_after_s: float | None = None) -> None:
        self.retry_after_s = retry_after_s
        super().__init__(message)


class RestartBudgetExhausted(EngineError):
    pass


class RequestRejected(GenfleetError):
    """The engine answered 400 for one prompt: permanent for that prompt, not for the batch."""

    def __init__(self, status: int, kind: str, message: str) -> None:
        self.status = status
        self.kind = kind
        super().__init__(message)


class RequestFailed(GenfleetError):
    """One try of one prompt failed while the engine answers: `finish_reason "abort"` on a
    200, a 5xx, a response that is not a chat completion. Sent again; after its tries it
    becomes an error record (never a completion) if the engine served other prompts meanwhile.
    `tokens`: what the engine generated for the try before it failed, when it said (an abort's
    partial answer); the error record counts them as spent.
    """

    def __init__(self, status: int, kind: str, message: str, tokens: int = 0) -> None:
        self.status = status
        self.kind = kind
        self.tokens = tokens
        super().__init__(message)


class BatchError(GenfleetError):
    """A batch stopped before its output was written; what finished is checkpointed."""


class BatchInterrupted(BatchError):
    """The worker is shutting down and cancelled the batch: the order goes back to the queue
    and the retry skips what the checkpoint holds (not a try, not a failure)."""


class BatchHandedBack(BatchInterrupted):
    """The worker handed its running batch back to the queue for a worker with room (its own
    engine restarting while no order waits): not a try, not a failure; the next try goes on
    from the checkpoint and the answers' ids, the engine deaths counted against its prompts
    kept with the batch."""


class BatchTerminated(BatchInterrupted):
    """An operator terminated the batch's task (Flower's terminate, `revoke(terminate=True)`):
    stopped on purpose, so it is parked in the failed set, where `genfleet retry` resends it,
    rather than handed back to be run again."""


class BatchCancelled(BatchError):
    """The run was cancelled (`genfleet cancel`) while the batch ran; what finished is
    checkpointed and the batch is parked."""


class BatchSuperseded(BatchError):
    """The order belongs to a staging its run no longer has (deleted, or staged anew under
    its name): acknowledged, never generated, nothing written (`workers.provenance`)."""


class ThinkingUnsupported(BatchError):
    """The run asks for no thinking and the model has no switch to turn it off: no worker of
    this model could honour the order, so it is failed, not generated with thinking on."""


class BatchFailed(BatchError):
    """A batch that exhausted its tries or cannot succeed; it is in the run's failed set."""
