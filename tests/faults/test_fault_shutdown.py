"""A worker told to stop (SIGTERM, `docker stop`, Ctrl-C in `genfleet run`) while a long batch
runs: it waits `shutdown_grace_s`, checkpoints the batch, hands it back to the queue and
exits; the next worker resumes it from the checkpoint. Nothing lost, nothing doubled."""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import redis

from genfleet.common import keys
from genfleet.common.queue_depth import queue_depth
from genfleet.common.routing import worker_queue
from genfleet.common.settings import Settings
from genfleet.producer.status import run_status
from harness.assertions import assert_exactly_once
from harness.env import base_env
from harness.processes import Worker
from harness.runs import fault_settings, open_run_store, stage, wait_run_done
from harness.sources import write_prompts
from harness.waits import wait_for

pytestmark = [pytest.mark.fault, pytest.mark.integration, pytest.mark.slow]


# One batch of 60 prompts on an engine at real-time pace: it runs for about ten seconds.
SLOW = {
    "emulator_time_scale": 1,
    "emulator_mean_completion_tokens": 300,
    "checkpoint_interval_s": 1,
    "worker_concurrency": 1,
}


def stop_mid_batch(
    tmp_path: Path,
    redis_url: str,
    redis_client: redis.Redis,
    start_worker: Callable[..., Worker],
    run: str,
    sig: signal.Signals,
    grace_s: float,
) -> tuple[Settings, list[str], Worker, float]:
    """Start a slow worker on a one-batch run, send `sig` once a few prompts are done, wait
    for it to exit; returns the settings, the input ids, the worker and seconds to exit."""
    store_url = (tmp_path / "store").as_uri()
    settings = fault_settings(redis_url, store_url, batch_size=60)
    ids = write_prompts(tmp_path / f"{run}.jsonl", 60)
    env = base_env(redis_url, store_url, shutdown_grace_s=grace_s, **SLOW)
    worker = start_worker(env, name=run)
    stage(settings, run, tmp_path / f"{run}.jsonl")
    worker.wait_ready()
    objects = open_run_store(settings)
    wait_for(
        lambda: run_status(objects, redis_client, run)["prompts_generated"] >= 5,
        60,
        "a few prompts of the batch",
        0.2,
    )
    signalled = time.monotonic()
    os.kill(worker.proc.pid, sig)
    worker.proc.wait(timeout=90)
    stopped_s = time.monotonic() - signalled
    print(f"worker stopped {stopped_s:.1f} s after {sig.name} (grace {grace_s} s)")
    return settings, ids, worker, stopped_s


def finish_elsewhere(
    redis_url: str,
    redis_client: redis.Redis,
    start_worker: Callable[..., Worker],
    settings: Settings,
    run: str,
    ids: list[str],
) -> list[dict[str, Any]]:
    """A second, fast worker completes the run; every prompt must be there exactly once.
    Returns the run's records."""
    second = start_worker(base_env(redis_url, settings.store, emulator_time_scale=50))
    second.wait_ready()
    objects = open_run_store(settings)
    wait_run_done(settings, redis_client, run, 120, objects)
    _result, rows = assert_exactly_once(settings, run, ids, redis_client, objects)
    return rows


def assert_handed_back(client: redis.Redis, settings: Settings, run: str) -> None:
    """The batch is back in the queue, its finished prompts in checkpoint parts, no output."""
    objects = open_run_store(settings)
    assert queue_depth(client, worker_queue(settings)) == 1
    assert list(objects.list(keys.parts_prefix(run, "batch-000000")))
    assert not objects.exists(keys.output_key(run, "batch-000000"))


def test_sigterm_checkpoints_and_hands_the_batch_back(
    tmp_path: Path,
    redis_url: str,
    redis_client: redis.Redis,
    start_worker: Callable[..., Worker],
) -> None:
    settings, ids, first, stopped_s = stop_mid_batch(
        tmp_path, redis_url, redis_client, start_worker, "stop", signal.SIGTERM, 2
    )
    assert stopped_s < 30
    assert_handed_back(redis_client, settings, "stop")

    rows = finish_elsewhere(redis_url, redis_client, start_worker, settings, "stop", ids)
    # the second worker took the checkpointed prompts (their records are the first's), not
    # redid them
    resumed = sum(1 for row in rows if row["engine"]["worker"] == first.hostname)
    assert 0 < resumed < len(ids)


def test_cold_shutdown_does_not_hang_and_loses_nothing(
    tmp_path: Path,
    redis_url: str,
    redis_client: redis.Redis,
    start_worker: Callable[..., Worker],
) -> None:
    """SIGQUIT (a second Ctrl-C): Celery asks the pool to terminate running tasks, which a
    threads pool cannot do; genfleet's pool cancels the batches instead, so the worker exits."""
    settings, ids, first, stopped_s = stop_mid_batch(
        tmp_path, redis_url, redis_client, start_worker, "cold", signal.SIGQUIT, 1
    )
    assert stopped_s < 30
    assert "does not implement kill_job" not in first.log.read_text()
    assert_handed_back(redis_client, settings, "cold")
    finish_elsewhere(redis_url, redis_client, start_worker, settings, "cold", ids)
