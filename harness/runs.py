"""A run on the real services, from the producer's side: its settings, staged, waited on until
a batch runs or the run is done, its leased batches, exported."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import orjson
import redis
from pydantic import SecretStr

from genfleet.common import keys
from genfleet.common.celery_config import REAPER_TASK
from genfleet.common.settings import Settings
from genfleet.common.store import Store, open_store
from genfleet.producer.enqueue import EnqueueResult, enqueue_run, reader_options
from genfleet.producer.export import ExportResult, export_run
from genfleet.producer.status import run_status
from harness.sources import write_prompt_lines, write_prompts
from harness.waits import wait_for


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


OTHER_MODEL = "other-model"


def stage_other_model_run(
    redis_url: str, store_url: str, directory: Path, run: str = "model-run"
) -> EnqueueResult:
    """A run of 20 prompts in two batches for another model (`OTHER_MODEL`, an external
    engine nobody runs) on the same Redis and store: its orders wait on that model's queue."""
    model = Settings(
        redis_url=SecretStr(redis_url),
        store=store_url,
        batch_size=10,
        engine="external",
        engine_url="http://127.0.0.1:9",
        served_model_name=OTHER_MODEL,
    )
    write_prompts(directory / "m.jsonl", 20, prefix="m")
    return enqueue_run(model, run, str(directory / "m.jsonl"), reader_options(model))


def stage_questions(
    settings: Settings, run: str, directory: Path, count: int, prefix: str = "q"
) -> EnqueueResult:
    """Stage `count` prompt lines, PREFIX0, PREFIX1, …, from DIRECTORY/RUN.jsonl as `run`."""
    source = write_prompt_lines(directory / f"{run}.jsonl", [f"{prefix}{i}" for i in range(count)])
    return stage(settings, run, source)


def wait_run_done(
    settings: Settings, client: redis.Redis, run: str, timeout_s: float, store: Store | None = None
) -> float:
    """Wait for every batch of `run` to have its output; returns how long that took (s).
    At the deadline it fails with where the run stood (its batches by state)."""
    objects = store or open_run_store(settings)
    started = time.monotonic()
    try:
        wait_for(
            lambda: run_status(objects, client, run)["state"] == "done",
            timeout_s,
            f"run {run} to finish",
            0.25,
        )
    except AssertionError as exc:
        status = run_status(objects, client, run)
        stood = {k: v for k, v in status.items() if k == "state" or k.startswith("batches_")}
        raise AssertionError(f"{exc}: {stood}") from None
    return time.monotonic() - started


def wait_run_ended(
    settings: Settings, client: redis.Redis, run: str, timeout_s: float
) -> dict[str, Any]:
    """Wait until `run` is done or failed; returns its status then."""
    objects = open_run_store(settings)

    def ended() -> dict[str, Any] | None:
        status = run_status(objects, client, run)
        return status if status["state"] in {"done", "failed"} else None

    status: dict[str, Any] = wait_for(ended, timeout_s, f"run {run} to end", 0.5)
    return status


def export_rows(
    settings: Settings, run: str, path: Path, **options: Any
) -> tuple[ExportResult, list[dict[str, Any]]]:
    """`export RUN --out PATH` (JSONL, whole runs only; `options` as export_run takes them) and
    the rows it wrote."""
    result = export_run(settings, run, str(path), "jsonl", False, **options)
    return result, [orjson.loads(line) for line in path.read_bytes().splitlines()]


def leases_of(client: redis.Redis, run: str, hostname: str | None = None) -> set[str]:
    """Batches of `run` whose lease `hostname` (or any worker) holds right now."""
    held = set()
    for key in client.scan_iter(match=keys.lease_key(run, "*")):
        if hostname is None or client.get(key) == hostname.encode():
            held.add(key.decode().rsplit(":", 1)[1])
    return held


def running_batches(
    client: redis.Redis,
    store: Store,
    run: str,
    hostname: str | None = None,
    checkpointed: bool = False,
) -> set[str]:
    """Batches of `run` running now: leased (by `hostname`, or by any worker), no output yet
    and, if `checkpointed`, a checkpoint part written (past their store reads)."""
    running = leases_of(client, run, hostname) - outputs(store, run)
    if checkpointed:
        running = {b for b in running if any(True for _ in store.list(keys.parts_prefix(run, b)))}
    return running


def wait_batch_running(
    client: redis.Redis,
    store: Store,
    run: str,
    hostname: str | None = None,
    checkpointed: bool = False,
    interval_s: float = 0.05,
) -> set[str]:
    """Wait (a minute at most) until a batch of `run` runs (`running_batches`); returns them."""
    what = f"a batch of {run} to be running" + (" and checkpointed" if checkpointed else "")
    found: set[str] = wait_for(
        lambda: running_batches(client, store, run, hostname, checkpointed), 60, what, interval_s
    )
    return found


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
