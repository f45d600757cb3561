"""Fixtures of the in-process core tests (task, batch): feeders over FakeChat, and the worker
runtime `generate_batch` reads, made of fakes (tests/fakes/runtime.py)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from genfleet.common.backoff import Backoff
from genfleet.common.settings import Settings
from genfleet.workers import tasks as tasks_module
from genfleet.workers.context import BatchTask
from genfleet.workers.feeding.feeder import Feeder
from tests.fakes.engine import FakeChat, FakeEngine
from tests.fakes.runtime import FakeRuntime
from tests.support.core import MakeFeeder, MakeRuntime


@pytest.fixture
def feeders() -> Iterator[MakeFeeder]:
    """`feeders(chat, max_inflight=4)`: a Feeder over `chat` that never retries a prompt
    itself; each is closed after the test."""
    started: list[Feeder] = []

    def make(chat: FakeChat, max_inflight: int = 4) -> Feeder:
        feeder = Feeder(
            lambda: chat, FakeEngine(), max_inflight, retries=0, backoff_s=lambda _: 0.0
        )
        started.append(feeder)
        return feeder

    yield make
    for feeder in started:
        feeder.close()


@pytest.fixture
def make_runtime(monkeypatch: pytest.MonkeyPatch, feeders: MakeFeeder) -> MakeRuntime:
    """`make_runtime(chat, batch_retries=2)`: the runtime `generate_batch` runs with from now
    on, its feeder over `chat`; batch retries without backoff."""

    def make(chat: FakeChat, batch_retries: int = 2) -> FakeRuntime:
        settings = Settings(batch_retries=batch_retries, lease_ttl_s=30, checkpoint_interval_s=60)
        fake = FakeRuntime(feeder=feeders(chat), settings=settings)
        monkeypatch.setattr(BatchTask, "runtime", fake)
        monkeypatch.setattr(tasks_module, "BATCH_RETRY", Backoff(base_s=0.0))
        return fake

    return make
