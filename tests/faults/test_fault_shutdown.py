"""A worker told to stop (SIGTERM, `docker stop`, Ctrl-C in `genfleet run`) while a long batch
runs: it waits `shutdown_grace_s`, checkpoints the batch, hands it back to the queue and
exits; the next worker resumes it from the checkpoint. Nothing lost, nothing doubled."""

from __future__ import annotations

import os
import re
import signal
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import redis

from common import keys
from producer.status import run_status
from tests.conftest import Worker, base_env, wait_for
from tests.faults.helpers import (
    assert_exactly_once,
    fault_settings,
    open_run_store,
    stage,
    wait_run_done,
    write_prompts,
)
from workers.watch import queue_depth

pytestmark = [pytest.mark.fault, pytest.mark.integration, pytest.mark.slow]


def test_sigterm_checkpoints_and_hands_the_batch_back(
    tmp_path: Path,
    redis_url: str,
    redis_client: redis.Redis,
    start_worker: Callable[..., Worker],
) -> None:
    store_url = (tmp_path / "store").as_uri()
    slow = {
        "emulator_time_scale": 1,
        "emulator_mean_completion_tokens": 300,
        "checkpoint_interval_s": 1,
        "shutdown_grace_s": 2,
        "worker_concurrency": 1,
    }
    settings = fault_settings(redis_url, store_url, batch_size=60)
    ids = write_prompts(tmp_path / "p.jsonl", 60)
    first = start_worker(base_env(redis_url, store_url, **slow), name="first")
    stage(settings, "stop", tmp_path / "p.jsonl")
    first.wait_ready()
    objects = open_run_store(settings)
    wait_for(
        lambda: run_status(objects, redis_client, "stop")["prompts_generated"] >= 5,
        60,
        "a few prompts of the batch",
        0.2,
    )
    signalled = time.monotonic()
    os.kill(first.proc.pid, signal.SIGTERM)
    first.proc.wait(timeout=60)
    stopped_s = time.monotonic() - signalled
    print(f"worker stopped {stopped_s:.1f} s after SIGTERM (grace 2 s)")
    assert stopped_s < 30
    log = first.log.read_text()
    assert "checkpointed and handed back" in log
    # the batch is back in the queue, its finished prompts in checkpoint parts, no output yet
    assert queue_depth(redis_client, settings.queue) == 1
    assert list(objects.list(keys.parts_prefix("stop", "batch-000000")))
    assert not objects.exists(keys.output_key("stop", "batch-000000"))

    second = start_worker(base_env(redis_url, store_url, emulator_time_scale=50), name="second")
    second.wait_ready()
    wait_run_done(settings, redis_client, "stop", 120, objects)
    resumed = wait_for(
        lambda: re.search(r"succeeded .*'resumed': (\d+)", second.log.read_text()),
        20,
        "the second worker's task result in its log",
        0.2,
    )
    assert int(resumed.group(1)) > 0  # it took the checkpointed prompts, not redid them
    assert_exactly_once(settings, "stop", ids, redis_client, objects)


def test_cold_shutdown_does_not_hang_and_loses_nothing(
    tmp_path: Path,
    redis_url: str,
    redis_client: redis.Redis,
    start_worker: Callable[..., Worker],
) -> None:
    """SIGQUIT (a second Ctrl-C): Celery asks the pool to terminate running tasks, which a
    threads pool cannot do; genfleet's pool cancels the batches instead, so the worker exits."""
    store_url = (tmp_path / "store").as_uri()
    slow = {
        "emulator_time_scale": 1,
        "emulator_mean_completion_tokens": 300,
        "checkpoint_interval_s": 1,
        "worker_concurrency": 1,
    }
    settings = fault_settings(redis_url, store_url, batch_size=60)
    ids = write_prompts(tmp_path / "p.jsonl", 60)
    first = start_worker(base_env(redis_url, store_url, **slow), name="cold")
    stage(settings, "cold", tmp_path / "p.jsonl")
    first.wait_ready()
    objects = open_run_store(settings)
    wait_for(
        lambda: run_status(objects, redis_client, "cold")["prompts_generated"] >= 5,
        60,
        "a few prompts of the batch",
        0.2,
    )
    signalled = time.monotonic()
    os.kill(first.proc.pid, signal.SIGQUIT)
    first.proc.wait(timeout=90)
    stopped_s = time.monotonic() - signalled
    print(f"worker stopped {stopped_s:.1f} s after SIGQUIT")
    assert "does not implement kill_job" not in first.log.read_text()
    assert not objects.exists(keys.output_key("cold", "batch-000000"))

    second = start_worker(base_env(redis_url, store_url, emulator_time_scale=50), name="warm")
    second.wait_ready()
    wait_run_done(settings, redis_client, "cold", 120, objects)
    assert_exactly_once(settings, "cold", ids, redis_client, objects)
