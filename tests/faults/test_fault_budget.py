"""An engine that keeps dying: the worker spends its restart budget, stops taking work and
says why; its batch finishes on a healthy worker, exactly once."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import redis

from genfleet.producer.status import run_status
from tests.faults.helpers import (
    assert_exactly_once,
    fault_settings,
    open_run_store,
    stage,
    write_prompts,
)
from tests.support import Worker, base_env, wait_for

pytestmark = [pytest.mark.fault, pytest.mark.integration, pytest.mark.slow]


def test_exhausted_budget_stops_consuming_and_the_run_finishes_elsewhere(
    tmp_path: Path,
    redis_url: str,
    redis_client: redis.Redis,
    start_worker: Callable[..., Worker],
) -> None:
    store = (tmp_path / "store").as_uri()
    settings = fault_settings(redis_url, store)
    ids = write_prompts(tmp_path / "p.jsonl", 100)
    broken = start_worker(
        base_env(redis_url, store, emulator_fail_after_requests=10, restart_budget=0),
        name="broken",
    )
    broken.wait_ready()
    stage(settings, "budget", tmp_path / "p.jsonl")
    from genfleet.workers.app import app

    def queues() -> list[str] | None:
        replies = app.control.inspect(destination=[broken.hostname], timeout=2).active_queues()
        if not replies or broken.hostname not in replies:
            return None
        return [q["name"] for q in replies[broken.hostname]]

    # the budget runs out (no restart allowed) and the worker stops consuming its queue
    assert wait_for(
        lambda: (q := queues()) is not None and "gpu.emulator" not in q, 60, "consumer gone"
    )
    assert broken.proc.poll() is None  # alive and answering, just not taking work
    healthy = start_worker(base_env(redis_url, store), name="healthy")
    healthy.wait_ready()
    objects = open_run_store(settings)
    wait_for(lambda: run_status(objects, redis_client, "budget")["state"] == "done", 120, "the run")
    assert_exactly_once(settings, "budget", ids, redis_client, objects)
