"""An engine that keeps dying: the worker spends its restart budget, stops taking work and
says why; its batch finishes on a healthy worker, exactly once."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import orjson
import pytest
import redis
from pydantic import SecretStr

from genfleet.common.settings import Settings
from genfleet.producer.status import read_findings, run_status
from harness.assertions import assert_exactly_once
from harness.env import base_env
from harness.processes import Worker
from harness.runs import fault_settings, open_run_store, stage
from harness.sources import write_prompts
from harness.waits import wait_for

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


CUDA_GRAPH_CRASH = (
    "RuntimeError: The expanded size of the tensor (33554432) must match the existing size "
    "(33558528) at non-singleton dimension 0"
)


def test_an_engine_dying_the_same_way_each_restart_is_named_and_comes_back_after_a_cool_down(
    tmp_path: Path,
    redis_url: str,
    redis_client: redis.Redis,
    start_worker: Callable[..., Worker],
) -> None:
    """SGLang 0.5.15's crash at its largest CUDA graph, emulated: the engine dies with the same
    last error whenever 8 requests run. The worker tells it from a flaky engine (a crash loop),
    names the error and the workaround in status, top and the findings, stops taking work
    when its restart budget is spent, and takes work again after the cool-down."""
    import shlex

    store = (tmp_path / "store").as_uri()
    crash_args = shlex.join(
        ["--emulator-crash-at-running", "8", "--emulator-crash-line", CUDA_GRAPH_CRASH]
    )
    env = base_env(
        redis_url,
        store,
        engine_extra_args=crash_args,
        restart_budget=3,
        restart_cooldown_s=4,
        power_window_s=5,
        log_dir=tmp_path,
    )
    worker = start_worker(env, name="looping")
    worker.wait_ready()
    settings = fault_settings(redis_url, store, batch_size=20)
    write_prompts(tmp_path / "p.jsonl", 60)
    stage(settings, "loop", tmp_path / "p.jsonl")
    from genfleet.common import keys
    from genfleet.producer.status import engine_alarm_text
    from genfleet.workers.app import app

    def spent() -> dict[str, Any] | None:
        raw = redis_client.hget(keys.engine_alarms_key(), worker.hostname)
        alarm = orjson.loads(raw) if raw else None
        return alarm if alarm and alarm["exhausted"] else None

    alarm = wait_for(spent, 60, "the restart budget to be spent")
    crash = alarm["crash"]
    assert crash["loop"] and crash["error"] == CUDA_GRAPH_CRASH and crash["repeats"] >= 3
    assert crash["known"] == "sglang_cuda_graph_verify_buffers"
    assert "--disable-cuda-graph" in crash["workaround"]

    # status: the run's queue's engine alarm, with the error and the fix
    report = run_status(open_run_store(settings), redis_client, "loop")
    (shown,) = report["engine_alarms"]
    line = engine_alarm_text(shown, time.time())
    assert "restart budget spent" in line and "crash loop" in line
    assert CUDA_GRAPH_CRASH in line and "--disable-cuda-graph" in line
    # the findings: the worker's own, for `genfleet findings` and `status --watch`
    found = {f["cause"]: f for f in read_findings(redis_client) if f["worker"] == worker.hostname}
    assert {"crash_loop", "restart_budget_spent"} <= set(found)
    for cause in ("crash_loop", "restart_budget_spent"):
        said = found[cause]["suggestion"]
        assert CUDA_GRAPH_CRASH in said and "--disable-cuda-graph" in said, said

    # top (and the power-watch, same rules): the row's cause and why, with the workaround
    from genfleet.workers.observe.top import rows

    def top_row() -> dict[str, Any] | None:
        data, _ = rows(Settings(redis_url=SecretStr(redis_url), store=store))
        mine = [r for r in data if r["worker"] == worker.hostname and r.get("why")]
        return mine[0] if mine else None

    row = wait_for(top_row, 30, "a top row naming the crash loop", 1.0)
    assert row["cause"] == "crash_loop" and "--disable-cuda-graph" in row["why"]

    def consumes() -> bool:
        replies = app.control.inspect(destination=[worker.hostname], timeout=2).active_queues()
        queues = (replies or {}).get(worker.hostname) or []
        return any(q["name"] == "gpu.emulator" for q in queues)

    # after the cool-down the engine starts again and the worker consumes again
    wait_for(consumes, 60, "the worker to consume again after its cool-down", 0.5)
    assert worker.proc.poll() is None
