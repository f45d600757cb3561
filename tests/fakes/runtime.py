"""The worker runtime `generate_batch` runs with (`workers.context.TaskRuntime`), made of fakes:
a real Feeder (over FakeChat), a MemoryStore and a MemoryRedis. It records what the task asked
of the worker: batches finished, refusals, findings, slots handed back."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from genfleet.common.settings import Settings
from genfleet.workers.batch import BatchSummary
from genfleet.workers.context import TaskRuntime
from genfleet.workers.feeding.feeder import Feeder
from genfleet.workers.observe.live_progress import ProgressTally
from genfleet.workers.refusals import RunVerdicts
from tests.fakes.memory_redis import MemoryRedis
from tests.fakes.memory_store import MemoryStore


@dataclass
class FakeRuntime:
    """The `TaskRuntime` of a worker serving the emulator queue, made of fakes."""

    feeder: Feeder
    settings: Settings
    store: MemoryStore = field(default_factory=MemoryStore)
    redis: MemoryRedis = field(default_factory=MemoryRedis)
    hostname: str = "w@test"
    queue: str = "gpu.emulator"  # the model queue it serves
    monitor: None = None
    progress: ProgressTally = field(default_factory=ProgressTally)
    finished: list[BatchSummary] = field(default_factory=list)

    refused: list[str] = field(default_factory=list)
    model_identity: dict[str, Any] | None = None
    model_verdicts: RunVerdicts = field(default_factory=lambda: RunVerdicts(600.0))
    findings: list[dict[str, Any]] = field(default_factory=list)
    ended: list[tuple[str, str]] = field(default_factory=list)
    presence_name: str | None = None
    hand_back_why: str | None = None  # what `handing_back()` answers

    def after_batch(self, summary: Any) -> None:
        self.finished.append(summary)

    def refuse_work(self, message: str) -> None:
        self.refused.append(message)

    def handing_back(self, run: str, batch: str) -> str | None:
        return self.hand_back_why

    def finding(
        self,
        cause: str,
        numbers: dict[str, Any],
        suggestion: str,
        verdict: str = "unresponsive",
        run: str | None = None,
    ) -> None:
        self.findings.append(
            {"worker": self.hostname, "cause": cause, "verdict": verdict, "run": run}
            | {"numbers": numbers, "suggestion": suggestion}
        )

    @property
    def lease_redis(self) -> MemoryRedis:
        return self.redis

    def batch_ended(self, run: str, batch: str) -> None:
        self.ended.append((run, batch))  # no Celery consumer whose prefetch to restore

    def consumer_started(self, qos: Any) -> None:
        return None  # no Celery consumer: nothing handed on to count


def _is_a_task_runtime(fake: FakeRuntime) -> TaskRuntime:
    return fake  # mypy checks here that the fake is a TaskRuntime
