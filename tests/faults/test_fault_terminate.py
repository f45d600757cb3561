"""Flower's "terminate" (`revoke(task_id, terminate=True)`) of one running task stops that
batch only: it is parked for `genfleet retry`, the worker's other batches run on."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import redis

from genfleet.common import keys
from genfleet.common.redis_conn import text
from genfleet.producer import commands
from harness.assertions import assert_exactly_once
from harness.env import base_env, free_port
from harness.processes import Worker
from harness.runs import (
    fault_settings,
    leases_of,
    open_run_store,
    outputs,
    stage,
    wait_run_done,
)
from harness.sources import write_prompts
from harness.waits import wait_for

pytestmark = [pytest.mark.fault, pytest.mark.integration, pytest.mark.slow]


def test_terminate_of_one_task_cancels_only_its_batch(
    tmp_path: Path,
    redis_url: str,
    redis_client: redis.Redis,
    start_worker: Callable[..., Worker],
) -> None:
    from genfleet.workers.app import app

    store_url = (tmp_path / "store").as_uri()
    env = base_env(redis_url, store_url, emulator_time_scale=2, log_dir=tmp_path, port=free_port())
    worker = start_worker(env)
    ids = write_prompts(tmp_path / "prompts.jsonl", 125)
    settings = fault_settings(redis_url, store_url)
    worker.wait_ready()
    store = open_run_store(settings)
    stage(settings, "term", tmp_path / "prompts.jsonl")
    running = wait_for(
        lambda: r if len(r := leases_of(redis_client, "term", worker.hostname)) >= 3 else None,
        60,
        "three batches running at once",
        0.05,
    )

    def active() -> dict[str, str]:
        replies = app.control.inspect(destination=[worker.hostname], timeout=2).active() or {}
        return {
            task["kwargs"]["order"]["batch"]: task["id"]
            for task in replies.get(worker.hostname, [])
        }

    tasks = wait_for(lambda: a if running <= set(a := active()) else None, 30, "active tasks")
    victim = sorted(running)[0]
    others = running - {victim}
    app.control.revoke(tasks[victim], terminate=True, destination=[worker.hostname])

    wait_for(lambda: redis_client.hexists(keys.failed_key("term"), victim), 30, "the batch parked")
    assert "terminated by an operator" in text(redis_client.hget(keys.failed_key("term"), victim))
    # The worker's other batches were not touched: they finish in this same try.
    wait_for(lambda: others <= outputs(store, "term"), 120, "the other running batches", 0.2)
    log = worker.log.read_text(errors="replace")
    for batch in others:
        assert f"term/{batch} interrupted" not in log
    assert victim not in outputs(store, "term")
    assert worker.proc.poll() is None

    commands.retry("term", redis_url=redis_url, store=store_url)
    wait_run_done(settings, redis_client, "term", 120, store)
    assert_exactly_once(settings, "term", ids, redis_client, store)
