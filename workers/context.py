"""What the generate task reaches, typed: the `TaskRuntime` protocol and the task base class
through which it gets one.

As arq hands each job its `ctx`, the engine bootstep (workers/app.py) builds the worker's
runtime before the worker consumes and attaches it here, to `BatchTask.runtime`, and takes it
away when the worker stops; nothing else sets it. The tests hand `generate_batch` a runtime of
fakes the same way. A task that runs with none (no engine started in this process) fails
with EngineError.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol

from celery import Task

from genfleet.common.celery_config import BEAT_RESULT_EXPIRES_S, HANDED_BACK_RESULT_EXPIRES_S
from genfleet.common.errors import EngineError

if TYPE_CHECKING:
    from genfleet.common.redis_conn import RedisCommands
    from genfleet.common.settings import Settings
    from genfleet.common.store import Store
    from genfleet.workers.feeding import Feeder
    from genfleet.workers.observe.live_progress import ProgressTally
    from genfleet.workers.observe.sampler import Monitor
    from genfleet.workers.refusals import RunVerdicts


class TaskRuntime(Protocol):
    """Exactly what `generate_batch` uses of the worker it runs in."""

    @property
    def settings(self) -> Settings: ...

    @property
    def hostname(self) -> str: ...

    @property
    def queue(self) -> str:
        """The one work queue (model) this worker serves."""

    @property
    def store(self) -> Store: ...

    @property
    def redis(self) -> RedisCommands: ...

    @property
    def lease_redis(self) -> RedisCommands:
        """A client whose calls end well inside one lease beat, for the lease heartbeat."""

    @property
    def feeder(self) -> Feeder | None: ...

    @property
    def monitor(self) -> Monitor | None: ...

    @property
    def progress(self) -> ProgressTally:
        """The live progress of the worker's running batches, written once an interval."""

    @property
    def presence_name(self) -> str | None:
        """The name of the worker's connection (workers/observe/liveness.py), None when unnamed."""

    @property
    def model_identity(self) -> dict[str, Any] | None:
        """The checkpoint fingerprint the worker computed at start (`engine.fingerprint`)."""

    @property
    def model_verdicts(self) -> RunVerdicts:
        """Whether this worker serves each run's model, as judged (workers/refusals.py)."""

    def refuse_work(self, message: str) -> None:
        """The engine refuses this worker itself (401/403/404): stop consuming, say why."""

    def handing_back(self, run: str, batch: str) -> str | None:
        """Why the running batch goes back to the queue now (`workers.hand_back`), or None."""

    def finding(
        self,
        cause: str,
        numbers: dict[str, Any],
        suggestion: str,
        verdict: str = "unresponsive",
        run: str | None = None,
    ) -> None:
        """A finding the worker makes about itself (or about itself and `run`): the log,
        `gpu_report` and the findings stream."""

    def batch_ended(self, run: str, batch: str) -> None:
        """The batch's task is over: the slot it handed on when every prompt was in the
        engine (wired into the feeder at start-up) is taken back."""

    def consumer_started(self, qos: Any) -> None:
        """The consumer's event loop starts (at start-up, after each reconnect) with `qos`,
        its prefetch count: the slots handed on by running batches are counted on it."""

    def after_batch(self, summary: Any) -> None:
        """After a batch that finished: read the engine's accept length into `summary`."""


class BatchTask(Task):  # type: ignore[misc]
    """The base of `generate_batch`: its `runtime`, set by the engine bootstep. The result of
    an order handed back as not this worker's model's expires after
    HANDED_BACK_RESULT_EXPIRES_S, not after the backend's week (as `BeatTask`'s)."""

    runtime: TaskRuntime | None = None

    def worker_runtime(self) -> TaskRuntime:
        runtime = type(self).runtime
        if runtime is None:
            raise EngineError("this process has no genfleet worker runtime (engine not started)")
        return runtime

    def after_return(
        self,
        status: str,
        retval: Any,
        task_id: str,
        args: Any,
        kwargs: Any,
        einfo: Any,
    ) -> None:
        if isinstance(retval, dict) and retval.get("refused"):
            key = self.backend.get_key_for_task(task_id)
            self.backend.expire(key, HANDED_BACK_RESULT_EXPIRES_S)


class BeatTask(Task):  # type: ignore[misc]
    """The base of the beat tasks (power-watch, lease reaper, progress reconcile): their
    results expire after BEAT_RESULT_EXPIRES_S, not after the backend's week. The backend's
    expiry is one for all tasks, so the result's key gets its own once stored (`after_return`
    runs after the result is written)."""

    def after_return(
        self,
        status: str,
        retval: Any,
        task_id: str,
        args: Any,
        kwargs: Any,
        einfo: Any,
    ) -> None:
        self.backend.expire(self.backend.get_key_for_task(task_id), BEAT_RESULT_EXPIRES_S)
