"""A worker lost between writing a batch's output and counting it: the reaper, which finds
the output and drops the batch's running entry, counts it in the same pass (once: not a batch
whose worker counted it before it was lost), so the run reads done at once rather than at the
next reconcile pass (two minutes later by default). Real Redis, the store in memory."""

from __future__ import annotations

from typing import Any

import pytest
import redis

from genfleet.common import keys, progress
from genfleet.common.ledger import Ledger, Tally, running_field
from genfleet.common.records import WorkOrder
from genfleet.workers.control.reaper import reap
from tests.fakes.memory_store import MemoryStore
from tests.support.stored_runs import STAGING_ID, finish, prompts, stage_prompts

pytestmark = pytest.mark.integration

NOW, TTL_S = 1_000_000.0, 60.0
RUN = "uncounted"
FIRST, COUNTED, LOST = keys.batch_id(0), keys.batch_id(1), keys.batch_id(2)


def test_a_batch_written_by_a_lost_worker_is_counted_in_the_reapers_pass(
    redis_client: redis.Redis,
) -> None:
    store = MemoryStore()
    manifest = stage_prompts(store, RUN, prompts(15), batch_size=5)
    progress.verify(store, redis_client, RUN, NOW - 3000)  # the run's copy, as enqueue leaves it
    ledger = Ledger(redis_client)
    # The first batch done and counted, as a worker does.
    finish(store, manifest, skip=frozenset({COUNTED, LOST}))
    ledger.done(RUN, FIRST, Tally(0, 20, 5, NOW - 2000), prompts=5)
    # Two batches claimed by workers that wrote their outputs and died: one after counting it,
    # one before.
    for batch in (COUNTED, LOST):
        order = WorkOrder(
            run=RUN,
            batch=batch,
            params=manifest.params,
            model="test-model",
            engine="emulator",
            prompts=5,
            staging=STAGING_ID,
        )
        ledger.claim(order.model_dump(mode="json"), f"w-{batch}@gone", NOW - 1000, "gone")
    finish(store, manifest, skip=frozenset({FIRST, LOST}))
    ledger.done(RUN, COUNTED, Tally(0, 20, 5, NOW - 1000), prompts=5)
    finish(store, manifest, skip=frozenset({FIRST, COUNTED}))
    before = progress.snapshot(redis_client, RUN)
    assert before is not None and (before.batches_done, before.prompts_done) == (2, 10)
    requeued: list[dict[str, Any]] = []

    def reap_at(now: float) -> dict[str, Any]:
        return reap(redis_client, store, TTL_S, now, requeued.append, 10, set())

    first = reap_at(NOW - TTL_S)  # a first look at the gone workers: nothing yet
    assert first["finished"] == [] and first["counted"] == []
    report = reap_at(NOW)

    assert sorted(report["finished"]) == [running_field(RUN, COUNTED), running_field(RUN, LOST)]
    assert report["counted"] == [running_field(RUN, LOST)] and requeued == []
    after = progress.snapshot(redis_client, RUN)
    assert after is not None and (after.batches_done, after.prompts_done) == (3, 15)
    assert reap_at(NOW + 1)["counted"] == []  # counted once
    again = progress.snapshot(redis_client, RUN)
    assert again is not None and again.prompts_done == 15
