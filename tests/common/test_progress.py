"""Redis's progress copy (common/progress.py): what `status` reads instead of the store.

Real Redis; the store is a file:// store (or the in-memory one where a test counts listings).
Checked: a plain status reads the copy without listing the store; a copy that is wrong on
purpose (a count, a missing batch, a batch without output) is repaired by the control
worker's reconcile pass and by `status --verify`; a Redis that lost everything is rebuilt
from the store by the next status.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis

from genfleet.common import keys, progress
from genfleet.common.manifest import BatchEntry, Manifest, write_manifest
from genfleet.common.records import GenerationParams
from genfleet.common.store import FileStore, Store
from genfleet.producer.runs.lifecycle import list_runs
from genfleet.producer.status import FAILED_SHOWN, run_status
from genfleet.workers.control import progress_repair as reconcile
from tests.fakes.memory_store import MemoryStore
from tests.support.stored_runs import STAGING_ID

pytestmark = pytest.mark.integration

RUN = "prog"
PROMPTS = (10, 10, 10, 10, 7)  # the last batch is shorter


def make_run(store: Store, done: int) -> Manifest:
    entries = [
        BatchEntry(batch=keys.batch_id(i), key=keys.input_key(RUN, keys.batch_id(i)), prompts=n)
        for i, n in enumerate(PROMPTS)
    ]
    manifest = write_manifest(
        store,
        RUN,
        STAGING_ID,
        entries,
        2,
        source="test",
        format="jsonl",
        fingerprint="0" * 64,
        created_at=time.time(),
        params=GenerationParams(max_tokens=16, temperature=0.0, top_p=1.0, thinking=False),
        model="emulator",
        engine="emulator",
        prompts_total=sum(PROMPTS),
        rejects=0,
    )
    for i in range(done):
        finish(store, i)
    return manifest


def finish(store: Store, index: int) -> None:
    store.put_if_absent(keys.output_key(RUN, keys.batch_id(index)), b"output")


class CountingStore(MemoryStore):
    """Counts its listings: a plain status must make none."""

    def __init__(self) -> None:
        super().__init__()
        self.listings = 0

    def list(self, prefix: str) -> Iterator[str]:
        self.listings += 1
        return super().list(prefix)


def test_status_reads_the_copy_without_listing_the_store(redis_client: redis.Redis) -> None:
    store = CountingStore()
    make_run(store, done=3)
    first = run_status(store, redis_client, RUN)  # no copy yet: listed once, copy written
    assert (first["batches_done"], first["prompts_done"]) == (3, 30)
    listed = store.listings

    finish(store, 3)  # written by a worker, which marks it in the same step
    pipe = redis_client.pipeline()
    progress.mark_written(pipe, RUN, keys.batch_id(3), 10)
    pipe.execute()
    for _ in range(5):
        report = run_status(store, redis_client, RUN)

    assert store.listings == listed  # never listed again
    assert (report["batches_done"], report["prompts_done"], report["state"]) == (4, 40, "running")
    assert run_status(store, redis_client, RUN, verify=True)["batches_done"] == 4
    assert store.listings == listed + 1


def corrupt(client: redis.Redis) -> None:
    """A copy wrong three ways: a count, a batch it lacks, a batch with no output."""
    client.hset(keys.counters_key(RUN), progress.PROMPTS_DONE, 999)
    client.hdel(keys.done_key(RUN), keys.batch_id(1))
    client.hset(keys.done_key(RUN), keys.batch_id(4), 7)  # batch 4 has no output
    client.hset(keys.failed_key(RUN), keys.batch_id(0), "EngineDown: then another copy wrote it")


def test_a_copy_wrong_on_purpose_is_repaired_by_the_reconcile_pass(
    redis_client: redis.Redis, tmp_path: Path
) -> None:
    store = FileStore(tmp_path)
    make_run(store, done=3)
    redis_client.sadd(keys.runs_key(), RUN)
    assert run_status(store, redis_client, RUN)["prompts_done"] == 30
    corrupt(redis_client)
    wrong = run_status(store, redis_client, RUN)
    assert (wrong["batches_done"], wrong["prompts_done"]) == (3, sum(PROMPTS))  # capped 999

    repairs = reconcile.reconcile_runs(store, redis_client).repairs

    assert [r.to_json() for r in repairs] == [
        {
            "run": RUN,
            "added": 1,
            "removed": 1,
            "recounted": 0,
            "unfailed": 1,
            "prompts_done_was": 999,
            "prompts_done": 30,
        }
    ]
    report = run_status(store, redis_client, RUN)
    assert (report["batches_done"], report["prompts_done"], report["state"]) == (3, 30, "running")
    assert report["batches_failed"] == 0
    assert reconcile.reconcile_runs(store, redis_client).repairs == []  # honest: no change


def test_status_verify_repairs_the_copy(redis_client: redis.Redis, tmp_path: Path) -> None:
    store = FileStore(tmp_path)
    make_run(store, done=5)
    run_status(store, redis_client, RUN)
    corrupt(redis_client)
    redis_client.hset(keys.done_key(RUN), keys.batch_id(2), 3)  # a wrong prompt count

    report = run_status(store, redis_client, RUN, verify=True)

    assert (report["batches_done"], report["prompts_done"], report["state"]) == (5, 47, "done")
    assert redis_client.hget(keys.done_key(RUN), keys.batch_id(2)) == b"10"


def test_a_redis_that_lost_everything_is_rebuilt_from_the_store(
    redis_client: redis.Redis, tmp_path: Path
) -> None:
    store = FileStore(tmp_path)
    make_run(store, done=2)
    assert run_status(store, redis_client, RUN)["batches_done"] == 2
    redis_client.flushdb()
    finish(store, 2)  # finished while Redis was gone: no worker could mark it

    report = run_status(store, redis_client, RUN)

    assert (report["batches_done"], report["prompts_done"]) == (3, 30)
    assert [row["done"] for row in list_runs(store, redis_client)] == [30]


def test_a_worker_marking_during_a_reconcile_is_not_lost(
    redis_client: redis.Redis, tmp_path: Path
) -> None:
    """A batch finished after the listing was taken stays done: the reconcile removes an entry
    only when a fresh existence check finds no output."""
    store = FileStore(tmp_path)
    manifest = make_run(store, done=2)
    listed = progress.listed_done(store, RUN)
    finish(store, 2)
    pipe = redis_client.pipeline()
    progress.mark_written(pipe, RUN, keys.batch_id(2), 10)
    pipe.execute()

    progress.reconcile(
        redis_client,
        store,
        manifest,
        listed,
        still_absent=lambda b: not store.exists(keys.output_key(RUN, b)),
    )

    snap = progress.snapshot(redis_client, RUN)
    assert snap is not None and (snap.batches_done, snap.prompts_done) == (3, 30)


def test_status_counts_every_failed_batch_and_shows_a_sample(
    redis_client: redis.Redis, tmp_path: Path
) -> None:
    store = FileStore(tmp_path)
    make_run(store, done=1)
    failed = {f"batch-{i:06d}": "EngineDown: gone" for i in range(1, 5)}
    failed.update({f"batch-{i:06d}": "EngineDown: gone" for i in range(100, 100 + FAILED_SHOWN)})
    redis_client.hset(keys.failed_key(RUN), mapping=failed)  # type: ignore[arg-type]

    report = run_status(store, redis_client, RUN)

    assert report["batches_failed"] == FAILED_SHOWN + 4
    assert len(report["failed"]) == FAILED_SHOWN and set(report["failed"]) <= set(failed)


def test_a_complete_run_leaves_the_registry_and_a_running_one_stays(
    redis_client: redis.Redis, tmp_path: Path
) -> None:
    store = FileStore(tmp_path)
    make_run(store, done=len(PROMPTS))
    redis_client.sadd(keys.runs_key(), RUN, "other")
    redis_client.sadd(keys.queued_key("other"), "batch-000000")

    first = reconcile.reconcile_runs(store, redis_client)  # verifies RUN complete
    second = reconcile.reconcile_runs(store, redis_client)

    assert first.retired == [] and second.retired == [RUN]
    assert redis_client.smembers(keys.runs_key()) == {b"other"}  # no manifest, still queued
    assert run_status(store, redis_client, RUN)["state"] == "done"


def test_a_run_that_cannot_be_read_does_not_stop_the_pass(
    redis_client: redis.Redis, tmp_path: Path
) -> None:
    store = FileStore(tmp_path)
    make_run(store, done=3)
    store.put(keys.manifest_key("broken"), b'{"run": "broken"}')  # not a manifest
    redis_client.sadd(keys.runs_key(), "broken", RUN)

    done = reconcile.reconcile_runs(store, redis_client)

    assert done.failed == ["broken"]
    assert [r.run for r in done.repairs] == [RUN]  # no copy yet: written from the listing
    assert run_status(store, redis_client, RUN)["batches_done"] == 3
