"""The checks a scenario ends with: nothing lost, doubled or marked done early."""

from __future__ import annotations

import collections
import os
from pathlib import Path
from typing import Any

import redis

from genfleet.common import keys
from genfleet.common.manifest import Manifest
from genfleet.common.records import decode_jsonl_gz
from genfleet.common.redis_conn import text
from genfleet.common.settings import Settings
from genfleet.common.store import Store
from genfleet.producer.export import ExportResult
from harness.runs import export_rows, open_run_store, outputs


def assert_exactly_once(
    settings: Settings,
    run: str,
    input_ids: list[str],
    client: redis.Redis | None = None,
    store: Store | None = None,
) -> tuple[ExportResult, list[dict[str, Any]]]:
    """Export `run` and check that nothing was lost, doubled or marked done early.

    Every input id appears exactly once, either as a completion (content, no error) or as an
    error record (type and message); the output objects themselves hold no repeated id (the
    export would hide one, so its duplicate count must be zero); every batch of the manifest
    has its output, and Redis's counters count nothing the outputs do not hold.
    """
    objects = store or open_run_store(settings)
    target = Path(os.environ.get("TMPDIR", "/tmp")) / f"genfleet-fault-{run}-{os.getpid()}.jsonl"
    try:
        result, rows = export_rows(settings, run, target)
    finally:
        target.unlink(missing_ok=True)
    counts = collections.Counter(row["id"] for row in rows)
    doubled = sorted(i for i, n in counts.items() if n > 1)
    assert not doubled, f"ids exported more than once: {doubled[:10]}"
    assert result.duplicates == 0, f"{result.duplicates} duplicate records in output objects"
    missing = sorted(set(input_ids) - set(counts))
    assert not missing, f"{len(missing)} input ids missing from the export: {missing[:10]}"
    extra = sorted(set(counts) - set(input_ids))
    assert not extra, f"ids in the export that were never input: {extra[:10]}"
    assert len(rows) == len(input_ids)
    for row in rows:
        if row["error"] is None:
            # An answer that ended while still thinking has reasoning and no content; one the
            # repetition guard stopped is exported without the loop's text.
            said = row["content"] is not None or bool(row.get("reasoning"))
            stopped = row.get("finish_reason") == "repetition"
            assert said or stopped, f"{row['id']}: no content, no reasoning and no error"
        else:
            assert row["error"].get("type") and row["error"].get("message"), row["error"]
    manifest = Manifest.load(objects, run)
    assert manifest is not None
    assert outputs(objects, run) >= set(manifest.batch_ids())
    if client is not None:
        assert_counters_backed(client, objects, run)
    return result, rows


def assert_counters_backed(client: redis.Redis, store: Store, run: str) -> None:
    """Redis's counters follow the store, never lead it: the completion tokens and errors it
    counted are at most what the output objects hold (read after the counters, so a batch
    counted between the two reads is already in the store)."""
    counters = {text(k): int(float(v)) for k, v in client.hgetall(keys.counters_key(run)).items()}
    tokens = errors = 0
    for key in store.list(keys.outputs_prefix(run)):
        for row in decode_jsonl_gz(store.get(key) or b""):
            if row.get("error"):
                errors += 1
            else:
                tokens += int((row.get("usage") or {}).get("completion_tokens") or 0)
    assert counters.get("completion_tokens", 0) <= tokens, (counters, tokens)
    assert counters.get("errors", 0) <= errors, (counters, errors)
