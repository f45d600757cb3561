"""Runs written straight into a store, as enqueue and the workers leave them, for the tests of
what reads them (export, report, the manifest's readers)."""

from __future__ import annotations

import gzip
import hashlib
from pathlib import Path
from typing import Any

import orjson

from genfleet.common import keys
from genfleet.common.manifest import BatchEntry, Manifest, write_manifest
from genfleet.common.records import (
    CompletionRecord,
    GenerationParams,
    PromptRecord,
    Usage,
    batch_digest,
    decode_jsonl_gz,
    dumps_jsonl,
    encode_jsonl_gz,
    line_digests,
)
from genfleet.common.store import Store
from genfleet.producer.batching import make_batches

# The staging id of the runs the tests write straight into a store.
STAGING_ID = "5ca1ab1e"


def stage_prompts(
    store: Store, run: str, prompts: list[PromptRecord], batch_size: int, shard_batches: int = 3
) -> Manifest:
    """What enqueue leaves in the store: one input object per batch (its content hash in the
    manifest, as staging records it) and the manifest (in shards of `shard_batches`, a few
    so that readers cross shards)."""
    entries = []
    for index, records in enumerate(make_batches(prompts, batch_size, 10**12, 16)):
        batch = keys.batch_id(index)
        key = keys.input_key(run, batch)
        raw = dumps_jsonl(r.to_json() for r in records)
        store.put(key, gzip.compress(raw, mtime=0))
        sha256 = batch_digest(line_digests(raw))
        entries.append(BatchEntry(batch=batch, key=key, prompts=len(records), sha256=sha256))
    return write_manifest(
        store,
        run,
        STAGING_ID,
        entries,
        shard_batches,
        source="test",
        format="jsonl",
        fingerprint="f",
        created_at=1_700_000_000.0,
        params=GenerationParams(max_tokens=16, temperature=0.6, top_p=0.95, thinking=True),
        model="test-model",
        engine="emulator",
        prompts_total=len(prompts),
        rejects=0,
    )


def completion(prompt: PromptRecord, run: str, batch: str) -> dict[str, Any]:
    """A plausible worker output for `prompt`; ids ending in `!` become error records."""
    failed = prompt.id.endswith("!")
    return CompletionRecord(
        id=prompt.id,
        run=run,
        batch=batch,
        messages=prompt.messages,
        reasoning=None if failed else f"thinking about {prompt.id}",
        content=None if failed else f"answer to {prompt.id}",
        finish_reason=None if failed else "stop",
        usage=Usage(10, 0 if failed else 20, 0 if failed else 5),
        model="test-model",
        engine={"kind": "emulator", "worker": "w1"},
        latency_s=0.5,
        error={"type": "context_length", "message": "too long"} if failed else None,
        sample=prompt.sample,
        custom_id=prompt.custom_id,
        request_id=None if failed else f"r-{prompt.id}-{prompt.sample}",
    ).to_json()


def finish(
    store: Store, manifest: Manifest, skip: frozenset[str] = frozenset(), repeat: int = 1
) -> None:
    """Write every batch's output object (each line `repeat` times), except those in `skip`."""
    for entry in manifest.entries(store):
        if entry.batch in skip:
            continue
        staged = store.get(entry.key) or b""
        prompts = [PromptRecord.from_json(d) for d in decode_jsonl_gz(staged)]
        digests = line_sha256s(gzip.decompress(staged))
        rows = [
            {**completion(p, manifest.run, entry.batch), "prompt_sha256": digest}
            for p, digest in zip(prompts, digests, strict=True)
            for _ in range(repeat)
        ]
        assert store.put_if_absent(
            keys.output_key(manifest.run, entry.batch), encode_jsonl_gz(rows)
        )


def line_sha256s(raw: bytes) -> list[str]:
    """What an output row names as its prompt: the sha256 of the prompt's staged line."""
    return [hashlib.sha256(line).hexdigest() for line in raw.splitlines()]


def prompts(n: int) -> list[PromptRecord]:
    return [PromptRecord(f"p{i:04d}", [{"role": "user", "content": f"q{i}"}]) for i in range(n)]


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    data = path.read_bytes()
    if path.name.endswith(".gz"):
        data = gzip.decompress(data)
    return [orjson.loads(line) for line in data.splitlines()]
