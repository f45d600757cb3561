"""The manifest: an index written last and the batch list in write-once shards, read in part;
a manifest of an older genfleet (one object holding every entry) still read, whole."""

from __future__ import annotations

import hashlib
from typing import Any

import orjson
import pytest

from genfleet.common import keys
from genfleet.common.errors import ManifestDamaged, RunMismatch
from genfleet.common.manifest import (
    IDENTITY_VERSION,
    BatchEntry,
    Manifest,
    ManifestWriter,
    write_manifest,
)
from genfleet.common.records import GenerationParams
from tests.fakes.memory_store import MemoryStore
from tests.support.stored_runs import STAGING_ID

RUN = "shards"
FIELDS: dict[str, Any] = {
    "source": "data.jsonl",
    "format": "jsonl",
    "fingerprint": "f" * 64,
    "created_at": 1_700_000_000.0,
    "params": GenerationParams(max_tokens=64, temperature=0.6, top_p=0.95, thinking=True),
    "model": "m",
    "engine": "emulator",
    "prompts_total": 25 * 4,
    "rejects": 0,
}


def entries(n: int) -> list[BatchEntry]:
    return [
        BatchEntry(
            batch=keys.batch_id(i),
            key=keys.input_key(RUN, keys.batch_id(i)),
            prompts=4,
            expected_tokens=256,
            longest_hint_tokens=i if i % 3 else None,
            sha256=hashlib.sha256(str(i).encode()).hexdigest(),
        )
        for i in range(n)
    ]


def shard(number: int) -> str:
    return keys.manifest_shard_key(RUN, STAGING_ID, number)


def test_the_batch_list_is_in_shards_and_one_batch_reads_one_shard() -> None:
    store = MemoryStore()
    write_manifest(store, RUN, STAGING_ID, entries(25), 10, **FIELDS)
    assert sorted(k for k in store.objects if "/manifest/" in k) == [shard(0), shard(1), shard(2)]
    index = store.objects[keys.manifest_key(RUN)]
    assert b"batch-000" not in index  # the index holds no entry
    store.reads.clear()

    manifest = Manifest.load(store, RUN)

    # the index, and the probe for a first change of its parameters (none): no shard
    assert manifest is not None
    assert store.reads == [keys.manifest_key(RUN), keys.params_change_key(RUN, 1)]
    assert (manifest.batches_total, manifest.shard_count, manifest.hinted) == (25, 3, True)
    assert [s.batches for s in manifest.shards] == [10, 10, 5]
    assert manifest.summary()["batches_total"] == 25
    assert manifest.batch_ids() == [keys.batch_id(i) for i in range(25)]
    store.reads.clear()
    assert manifest.entry(store, "batch-000013") == entries(25)[13]
    assert manifest.entry(store, "batch-000017") == entries(25)[17]
    assert store.reads == [shard(1)]  # the shard read last is kept for its neighbours
    assert manifest.entry(store, "batch-000025") is None  # no such batch
    assert manifest.entry(store, "batch-0000013") is None  # not an id this run gives
    assert not manifest.has_batch("outputs") and manifest.has_batch("batch-000024")
    store.reads.clear()
    assert list(manifest.entries(store)) == entries(25)
    assert store.reads == [shard(0), shard(1), shard(2)]


def test_a_shard_missing_or_not_what_the_index_says_is_refused() -> None:
    store = MemoryStore()
    write_manifest(store, RUN, STAGING_ID, entries(25), 10, **FIELDS)
    manifest = Manifest.load(store, RUN)
    assert manifest is not None
    store.objects[shard(1)] = store.objects[shard(1)].replace(b'"prompts":4', b'"prompts":5', 1)
    with pytest.raises(ManifestDamaged, match=f"{shard(1)} .* is not the shard"):
        list(manifest.entries(store))
    del store.objects[shard(2)]
    with pytest.raises(ManifestDamaged, match=f"{shard(2)} is missing"):
        manifest.entry(store, "batch-000020")
    # An index whose shards do not cover its batches is no manifest.
    broken = orjson.loads(store.objects[keys.manifest_key(RUN)])
    broken["batches_total"] = 31
    store.objects[keys.manifest_key(RUN)] = orjson.dumps(broken)
    with pytest.raises(ValueError, match="3 shards of 25 batches for 31 batches"):
        Manifest.load(store, RUN)


def test_a_staging_resumed_finds_its_own_shards_and_refuses_other_ones() -> None:
    store = MemoryStore()
    first = write_manifest(store, RUN, STAGING_ID, entries(25), 10, **FIELDS)
    del store.objects[keys.manifest_key(RUN)]  # interrupted before its index
    again = write_manifest(store, RUN, STAGING_ID, entries(25), 10, **FIELDS)
    assert again.shards == first.shards

    other = entries(25)
    other[12] = other[12].model_copy(update={"prompts": 3})
    del store.objects[keys.manifest_key(RUN)]
    with pytest.raises(RunMismatch, match=f"{shard(1)}, written by an earlier try"):
        write_manifest(store, RUN, STAGING_ID, other, 10, **FIELDS)
    assert keys.manifest_key(RUN) not in store.objects
    writer = ManifestWriter(store, RUN, STAGING_ID, 10)
    with pytest.raises(ValueError, match="batch-000001 staged where batch-000000 comes next"):
        writer.add(entries(2)[1])


def whole_manifest(version: int, batches: list[BatchEntry]) -> bytes:
    """A manifest as genfleet wrote it before shards: one object with every entry."""
    fields = {**FIELDS, "params": FIELDS["params"].model_dump(), "version": version}
    fields.update(run=RUN, staging_id=STAGING_ID, sources_unread=[], rows_unread=0)
    fields["batches"] = [entry.model_dump() for entry in batches]
    return orjson.dumps(fields, option=orjson.OPT_INDENT_2)


def test_a_manifest_of_an_older_genfleet_is_read_whole() -> None:
    store = MemoryStore()
    store.put(keys.manifest_key(RUN), whole_manifest(2, entries(25)))

    manifest = Manifest.load(store, RUN)

    assert manifest is not None and not manifest.sharded
    assert (manifest.version, manifest.batches_total, manifest.shard_count) == (2, 25, 1)
    assert list(manifest.entries(store)) == entries(25)
    assert manifest.entry(store, "batch-000013") == entries(25)[13]
    assert manifest.batch_ids() == [keys.batch_id(i) for i in range(25)]
    assert manifest.identity().fingerprint == FIELDS["fingerprint"]  # its identity is checked
    assert manifest.version >= IDENTITY_VERSION
    assert manifest.hinted
    store.put(keys.manifest_key(RUN), whole_manifest(1, entries(3)))
    oldest = Manifest.load(store, RUN)
    assert oldest is not None and oldest.identity().fingerprint == "v1-unchecked"


def test_shard_keys_take_only_a_staging_id() -> None:
    with pytest.raises(ValueError, match="not a hex token"):
        keys.manifest_shard_key(RUN, "../../elsewhere", 0)
    with pytest.raises(ValueError, match="not a hex token"):
        ManifestWriter(MemoryStore(), RUN, "")


def test_parameter_changes_apply_in_order_and_are_write_once() -> None:
    store = MemoryStore()
    write_manifest(store, RUN, STAGING_ID, entries(3), 10, **FIELDS)
    first = Manifest.load(store, RUN)
    assert first is not None and first.changes == []
    first.record_change(store, {"max_tokens": 4096}, 1.0, "--change-params")
    assert first.params.max_tokens == 4096
    second = Manifest.load(store, RUN)
    assert second is not None
    second.record_change(store, {"thinking": False, "max_tokens": 512}, 2.0, "--change-params")
    read = Manifest.load(store, RUN)
    assert read is not None
    assert (read.params.max_tokens, read.params.thinking, read.params.temperature) == (
        512,
        False,
        0.6,
    )
    assert read.identity().params["max_tokens"] == 512
    assert [c["at"] for c in read.changes] == [1.0, 2.0]
    # A command that read the run before the second change cannot record another first.
    with pytest.raises(RunMismatch, match="changed its parameters meanwhile"):
        first.record_change(store, {"max_tokens": 128}, 3.0, "--change-params")
    assert Manifest.load(store, RUN).params.max_tokens == 512  # type: ignore[union-attr]
