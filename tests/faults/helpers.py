"""What every fault scenario shares: datasets, process lookups and the exactly-once check.

A scenario breaks something while a real run goes on, lets genfleet recover, then calls
`assert_exactly_once`: the export holds every input id exactly once (a completion or an error
record), nothing doubled, and no batch is marked done in Redis without its output object.
"""

from __future__ import annotations

import collections
import contextlib
import os
import time
from pathlib import Path
from typing import Any

import orjson
import redis
from pydantic import SecretStr

from genfleet.common import keys
from genfleet.common.celery_config import REAPER_TASK
from genfleet.common.manifest import Manifest
from genfleet.common.records import decode_jsonl_gz
from genfleet.common.redis_conn import text
from genfleet.common.settings import Settings
from genfleet.common.store import Store, open_store
from genfleet.producer.enqueue import EnqueueResult, enqueue_run, reader_options
from genfleet.producer.export import ExportResult, export_run
from genfleet.producer.status import run_status
from tests.support import Worker, wait_for


def write_prompts(
    path: Path, count: int, marked: dict[int, str] | None = None, prefix: str = "p"
) -> list[str]:
    """`count` short chat prompts; `marked[i]` replaces the i-th prompt's text. Returns ids."""
    ids = [f"{prefix}{i:05d}" for i in range(count)]
    with path.open("wb") as handle:
        for i, prompt_id in enumerate(ids):
            text = (marked or {}).get(i, f"Question {i}: what is {i} + {i}?")
            row = {"id": prompt_id, "messages": [{"role": "user", "content": text}]}
            handle.write(orjson.dumps(row) + b"\n")
    return ids


def fault_settings(redis_url: str, store: str, **overrides: Any) -> Settings:
    """The producer side's settings; batches small enough that a run has several."""
    values: dict[str, Any] = {"batch_size": 25, "max_tokens": 1024}
    values.update(overrides)
    return Settings(redis_url=SecretStr(redis_url), store=store, **values)


def stage(settings: Settings, run: str, source: Path) -> EnqueueResult:
    return enqueue_run(settings, run, str(source), reader_options(settings))


def open_run_store(settings: Settings) -> Store:
    return open_store(settings.store, settings.s3_endpoint_url, settings.s3_region)


def outputs(store: Store, run: str) -> set[str]:
    """Batches whose output object exists: what "done" means."""
    return {keys.batch_from_output_key(k) for k in store.list(keys.outputs_prefix(run))}


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


def wait_run_done(
    settings: Settings, client: redis.Redis, run: str, timeout_s: float, store: Store | None = None
) -> float:
    """Wait for every batch of `run` to have its output; returns how long that took (s)."""
    objects = store or open_run_store(settings)
    started = time.monotonic()
    wait_for(
        lambda: run_status(objects, client, run)["state"] == "done",
        timeout_s,
        f"run {run} to finish",
        0.25,
    )
    return time.monotonic() - started


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
        result = export_run(settings, run, str(target), "jsonl", partial=False)
        rows = [orjson.loads(line) for line in target.read_bytes().splitlines()]
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
            assert row["content"] is not None, f"{row['id']}: no content and no error"
        else:
            assert row["error"].get("type") and row["error"].get("message"), row["error"]
    manifest = Manifest.load(objects, run)
    assert manifest is not None
    assert outputs(objects, run) >= set(manifest.batch_ids())
    if client is not None:
        assert_counters_backed(client, objects, run)
    return result, rows


def pid_alive(pid: int) -> bool:
    """True while `pid` exists and is not a zombie."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def child_pids(pid: int) -> list[int]:
    """Direct children of `pid`, by parent pid in /proc/*/stat (no /proc children files here)."""
    found: list[int] = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        with contextlib.suppress(OSError, IndexError, ValueError):
            fields = stat.read_text().rsplit(")", 1)[1].split()
            if int(fields[1]) == pid:
                found.append(int(stat.parent.name))
    return sorted(found)


def engine_pid(worker: Worker) -> int | None:
    """The pid of the worker's emulator engine, or None while it has none."""
    for pid in child_pids(worker.proc.pid):
        with contextlib.suppress(OSError):
            if b"genfleet.workers.engine.emulator" in Path(f"/proc/{pid}/cmdline").read_bytes():
                if pid_alive(pid):
                    return pid
    return None


def leases_of(client: redis.Redis, run: str, hostname: str) -> set[str]:
    """Batches of `run` whose lease `hostname` holds right now (it is running them)."""
    held = set()
    for key in client.scan_iter(match=keys.lease_key(run, "*")):
        if client.get(key) == hostname.encode():
            held.add(key.decode().rsplit(":", 1)[1])
    return held


def reaped(client: redis.Redis, run: str) -> list[str]:
    """Batches of `run` the lease reaper re-enqueued, from its task results in the result
    backend (one entry per re-enqueue)."""
    found: list[str] = []
    for key in client.scan_iter(match="celery-task-meta-*", count=500):
        meta = orjson.loads(client.get(key) or b"{}")
        if meta.get("name") != REAPER_TASK or meta.get("status") != "SUCCESS":
            continue
        found += [field for field in meta["result"]["requeued"] if field.startswith(f"{run}/")]
    return found


def log_count(worker: Worker, text: str) -> int:
    return worker.log.read_text(errors="replace").count(text)
