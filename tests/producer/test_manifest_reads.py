"""Resume, retry, export and `status --verify` read a run's manifest a shard at a time (never
its whole batch list), and a run staged by an older genfleet (one manifest object) still
resumes, exports and verifies."""

from __future__ import annotations

from pathlib import Path

import orjson
import pytest
import redis

from genfleet.common import keys, progress
from genfleet.common.manifest import Manifest
from genfleet.common.records import WorkOrder
from genfleet.common.settings import Settings
from genfleet.common.store import open_store
from genfleet.producer import enqueue
from genfleet.producer.enqueue import enqueue_missing, enqueue_run, reader_options
from genfleet.producer.export import export_run, scan_store
from genfleet.producer.status import run_status
from tests.fakes.memory_store import MemoryStore
from tests.support.stored_runs import STAGING_ID, finish, prompts, stage_prompts

pytestmark = pytest.mark.integration

RUN = "parts"
SHARD = 4  # batches per shard: 30 batches are 8 shards


def staged(store: MemoryStore, done: frozenset[str] = frozenset()) -> Manifest:
    manifest = stage_prompts(store, RUN, prompts(30), batch_size=1, shard_batches=SHARD)
    finish(store, manifest, skip=frozenset(manifest.batch_ids()) - done)
    store.reads.clear()
    return manifest


def shard_reads(store: MemoryStore) -> list[int]:
    """The shards read, in order, by number."""
    prefix = keys.manifest_shard_key(RUN, STAGING_ID, 0).rsplit("/", 1)[0] + "/shard-"
    return [int(k[len(prefix) : -len(".json")]) for k in store.reads if k.startswith(prefix)]


def test_a_resume_streams_the_shards_and_sends_as_it_reads(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    store = MemoryStore()
    done = frozenset(keys.batch_id(i) for i in (0, 5, 6, 29))
    manifest = staged(store, done)
    monkeypatch.setattr(enqueue, "SEND_CHUNK", 3)
    sends: list[tuple[int, list[str]]] = []  # shards read when each chunk went out

    def send(orders: list[WorkOrder]) -> int:
        sends.append((len(shard_reads(store)), [o.batch for o in orders]))
        return len(orders)

    result = enqueue_missing(store, manifest, send, set(), done=set(done))

    assert result.batches_enqueued == 26
    assert [b for _, chunk in sends for b in chunk] == sorted(set(manifest.batch_ids()) - done)
    assert shard_reads(store) == list(range(8))  # each shard once, in order
    assert sends[0][0] == 1  # the first orders left with one shard read, not eight
    assert all(len(chunk) <= 3 for _, chunk in sends)
    assert keys.manifest_key(RUN) not in store.reads  # the caller's index is enough


def test_export_and_verify_read_the_shards_one_at_a_time(redis_client: redis.Redis) -> None:
    store = MemoryStore()
    manifest = staged(store, frozenset(keys.batch_id(i) for i in range(30) if i != 9))

    scan = scan_store(store, RUN)
    assert shard_reads(store) == []  # done and missing come from the index and the listing
    outputs = []
    for record in scan.records():
        outputs.append(record["batch"])
        assert max(shard_reads(store), default=0) <= keys.batch_index(record["batch"]) // SHARD
    assert scan.missing == ["batch-000009"] and len(outputs) == 29
    assert shard_reads(store) == list(range(8))

    store.reads.clear()
    verified = progress.verify(store, redis_client, RUN)
    assert verified is not None and verified.snapshot.batches_done == 29
    assert shard_reads(store) == list(range(8))
    assert manifest.batches_total == 30


def whole_manifest(store_root: Path, run: str) -> None:
    """Rewrite a staged run's manifest as genfleet wrote it before shards: one object."""
    store = open_store(store_root.as_uri())
    manifest = Manifest.load(store, run)
    assert manifest is not None and manifest.sharded
    fields = manifest.model_dump(exclude={"batches_total", "shard_batches", "shards"})
    fields.update(version=2, batches=[e.model_dump() for e in manifest.entries(store)])
    store.delete_prefix(f"{run}/manifest/")
    store.put(keys.manifest_key(run), orjson.dumps(fields, option=orjson.OPT_INDENT_2))


def test_a_run_staged_before_shards_resumes_exports_and_verifies(
    tmp_path: Path, redis_url: str, redis_client: redis.Redis
) -> None:
    root = tmp_path / "store"
    settings = Settings(redis_url=redis_url, store=root.as_uri(), batch_size=10)
    source = tmp_path / "p.jsonl"
    source.write_bytes(b"".join(orjson.dumps({"prompt": f"q{i}"}) + b"\n" for i in range(50)))
    options = reader_options(settings)
    enqueue_run(settings, "old", str(source), options)
    whole_manifest(root, "old")
    store = open_store(settings.store)
    manifest = Manifest.load(store, "old")
    assert manifest is not None and not manifest.sharded
    finish(store, manifest, skip=frozenset({"batch-000001", "batch-000003"}))
    redis_client.flushdb()  # Redis lost everything: the store alone rebuilds the run

    resumed = enqueue_run(settings, "old", None, options, verify=True)
    assert (resumed.batches_total, resumed.batches_done, resumed.batches_enqueued) == (5, 3, 2)
    assert run_status(store, redis_client, "old", verify=True)["batches_done"] == 3
    again = enqueue_run(settings, "old", str(source), options)  # the same data: no mismatch
    assert again.batches_enqueued == 0
    result = export_run(settings, "old", str(tmp_path / "out.jsonl"), partial=True)
    assert (result.records, result.missing_batches) == (30, ["batch-000001", "batch-000003"])
