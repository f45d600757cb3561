"""A worker lost between writing a batch's output and counting it: the reaper, which finds
the output and drops the batch's running entry, repairs the run's progress from the store in
the same pass, so the run reads done at once rather than at the next reconcile pass (two
minutes later by default). Real Redis, the store in memory."""

from __future__ import annotations

from typing import Any

import pytest
import redis

from genfleet.common import keys, progress
from genfleet.common.ledger import Ledger, running_field
from genfleet.common.records import WorkOrder
from genfleet.workers.control.progress_repair import repair_run
from genfleet.workers.control.reaper import reap
from tests.fakes.memory_store import MemoryStore
from tests.support.stored_runs import STAGING_ID, finish, prompts, stage_prompts

pytestmark = pytest.mark.integration

NOW, TTL_S = 1_000_000.0, 60.0
RUN = "uncounted"
FIRST, LOST = keys.batch_id(0), keys.batch_id(1)


def test_a_batch_written_by_a_lost_worker_is_counted_in_the_reapers_pass(
    redis_client: redis.Redis,
) -> None:
    store = MemoryStore()
    manifest = stage_prompts(store, RUN, prompts(10), batch_size=5)
    # The first batch done and counted, as a worker does.
    finish(store, manifest, skip=frozenset({LOST}))
    repair_run(store, redis_client, RUN, NOW - 2000)  # type: ignore[arg-type]
    before = progress.snapshot(redis_client, RUN)
    assert before is not None and (before.batches_done, before.prompts_done) == (1, 5)
    # The second: claimed by a worker that wrote its output and died before counting it.
    order = WorkOrder(
        run=RUN,
        batch=LOST,
        params=manifest.params,
        model="test-model",
        engine="emulator",
        prompts=5,
        staging=STAGING_ID,
    )
    Ledger(redis_client).claim(order.model_dump(mode="json"), "w@gone", NOW - 1000, "gone")
    finish(store, manifest, skip=frozenset({FIRST}))
    requeued: list[dict[str, Any]] = []

    def reap_at(now: float) -> dict[str, Any]:
        return reap(redis_client, store, TTL_S, now, requeued.append, 10, set())

    first = reap_at(NOW - TTL_S)  # a first look at the gone worker: nothing yet
    assert first["finished"] == [] and first["repaired"] == []
    report = reap_at(NOW)

    assert report["finished"] == [running_field(RUN, LOST)] and requeued == []
    assert [r["added"] for r in report["repaired"]] == [1]
    after = progress.snapshot(redis_client, RUN)
    assert after is not None and (after.batches_done, after.prompts_done) == (2, 10)
    assert reap_at(NOW + 1)["repaired"] == []  # counted once: nothing to repair again
