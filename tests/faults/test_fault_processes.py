"""Processes dying mid-batch: a whole worker (SIGKILL), or only its engine (SIGKILL).

The emulator runs slower here than in the other integration tests so that a batch lasts a
few seconds and the kill lands while it runs. Each test ends with `assert_exactly_once`.
"""

from __future__ import annotations

import collections
import os
import signal
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, NamedTuple

import pytest
import redis

from genfleet.common.queue_depth import queue_depth
from genfleet.common.routing import worker_queue
from genfleet.common.settings import Settings
from genfleet.common.store import Store
from harness.assertions import assert_exactly_once
from harness.control import engine_report, wait_engine_up
from harness.env import base_env, free_port
from harness.processes import Worker, engine_pid, pid_alive
from harness.runs import (
    fault_settings,
    open_run_store,
    outputs,
    reaped,
    stage,
    wait_batch_running,
    wait_run_done,
)
from harness.sources import write_prompts
from harness.waits import wait_for

pytestmark = [pytest.mark.fault, pytest.mark.integration, pytest.mark.slow]

# A 25-prompt batch lasts one to three seconds at this speed (heavy-tailed completion lengths
# up to 1024 tokens), and checkpoints every second, so a kill lands mid-batch after a part.
SLOW = {"emulator_time_scale": 4, "checkpoint_interval_s": 1}


def test_sigkilled_worker_batch_finishes_on_another_worker(
    tmp_path: Path,
    redis_url: str,
    redis_client: redis.Redis,
    start_worker: Callable[..., Worker],
) -> None:
    store_url = (tmp_path / "store").as_uri()
    env = base_env(
        redis_url, store_url, lease_ttl_s=3, reaper_interval_s=2, log_dir=tmp_path, **SLOW
    )
    control = start_worker(env, role="control")
    # Own engine ports: two workers starting at once could both find the same port free.
    doomed = start_worker({**env, "GENFLEET_PORT": str(free_port())}, name="doomed")
    survivor = start_worker({**env, "GENFLEET_PORT": str(free_port())}, name="survivor")
    ids = write_prompts(tmp_path / "prompts.jsonl", 250)
    settings = fault_settings(redis_url, store_url)
    for worker in (control, doomed, survivor):
        worker.wait_ready()
    store = open_run_store(settings)
    stage(settings, "killworker", tmp_path / "prompts.jsonl")

    held = wait_batch_running(redis_client, store, "killworker", doomed.hostname, checkpointed=True)
    engine = engine_pid(doomed)
    assert engine is not None
    doomed.kill(signal.SIGKILL)
    killed_at = time.monotonic()
    doomed.proc.wait(timeout=10)
    lost = held - outputs(store, "killworker")
    assert lost, "the batch finished before the kill: nothing was interrupted"

    # PR_SET_PDEATHSIG: the engine gets SIGTERM when its worker dies, even by SIGKILL.
    wait_for(lambda: not pid_alive(engine), 20, f"the dead worker's engine (pid {engine}) to exit")
    engine_gone_s = time.monotonic() - killed_at

    wait_for(
        lambda: lost <= outputs(store, "killworker"),
        180,
        f"the interrupted batches {sorted(lost)} to finish on the surviving worker",
        0.2,
    )
    recovery_s = time.monotonic() - killed_at
    assert recovery_s < 180
    wait_run_done(settings, redis_client, "killworker", 120, store)
    result, rows = assert_exactly_once(settings, "killworker", ids, redis_client, store)
    assert result.errors == 0
    # Resumed prompts keep the record the dead worker checkpointed; the rest are the survivor's.
    workers = collections.Counter(row["engine"]["worker"] for row in rows if row["batch"] in lost)
    assert set(workers) <= {doomed.hostname, survivor.hostname}
    resumed = workers[doomed.hostname]
    assert resumed > 0, "the retry redid prompts that were checkpointed"
    requeued = reaped(redis_client, "killworker")
    assert {f"killworker/{batch}" for batch in lost} <= set(requeued)
    print(
        f"\n[fault kill-worker] SIGKILL with {sorted(lost)} running; its engine exited after "
        f"{engine_gone_s:.1f} s; the batch finished on the other worker {recovery_s:.1f} s after "
        f"the kill (lease 3 s, reaper 2 s; {len(requeued)} re-enqueued by the reaper; "
        f"{resumed} prompts resumed from checkpoint parts)"
    )


def test_sigkilled_engine_is_restarted_and_the_batch_completes(
    tmp_path: Path,
    redis_url: str,
    redis_client: redis.Redis,
    start_worker: Callable[..., Worker],
) -> None:
    store_url = (tmp_path / "store").as_uri()
    worker = start_worker(
        base_env(redis_url, store_url, log_dir=tmp_path, port=free_port(), **SLOW)
    )
    ids = write_prompts(tmp_path / "prompts.jsonl", 150)
    settings = fault_settings(redis_url, store_url)
    worker.wait_ready()
    store = open_run_store(settings)
    stage(settings, "killengine", tmp_path / "prompts.jsonl")

    held = wait_batch_running(redis_client, store, "killengine", worker.hostname)
    first = engine_pid(worker)
    assert first is not None
    os.kill(first, signal.SIGKILL)
    killed_at = time.monotonic()
    assert held - outputs(store, "killengine"), "the batch finished before the kill"

    second = wait_for(
        lambda: (pid := engine_pid(worker)) not in (None, first) and pid,
        60,
        "the supervisor to start a new engine",
        0.1,
    )
    wait_engine_up(worker.broker_url, worker.hostname, restarts=1)
    restart_s = time.monotonic() - killed_at
    wait_run_done(settings, redis_client, "killengine", 120, store)
    done_s = time.monotonic() - killed_at
    result, _rows = assert_exactly_once(settings, "killengine", ids, redis_client, store)
    assert result.errors == 0
    assert worker.proc.poll() is None and pid_alive(second)
    assert engine_report(worker.broker_url, worker.hostname)["restarts"] == 1
    print(
        f"\n[fault kill-engine] engine SIGKILLed with {sorted(held)} running; a new engine was "
        f"ready {restart_s:.1f} s later; run done {done_s:.1f} s after the kill; "
        f"{result.records} records"
    )


class SlowRestart(NamedTuple):
    """Two workers, the first one's engine slow to start (8 s), SIGKILLed mid-batch once
    every order of `run` is taken: `cut` are its batches that were running."""

    restarting: Worker
    roomy: Worker
    settings: Settings
    store: Store
    ids: list[str]
    cut: set[str]
    killed_at: float


def kill_a_slow_engine_with_no_order_waiting(
    tmp_path: Path,
    redis_url: str,
    redis_client: redis.Redis,
    start_worker: Callable[..., Worker],
    run: str,
    **overrides: Any,
) -> SlowRestart:
    store_url = (tmp_path / "store").as_uri()
    env = base_env(
        redis_url, store_url, log_dir=tmp_path, emulator_mean_completion_tokens=600, **SLOW
    )
    # Its engine at the emulator's own pace: the kill lands with every answer part-way.
    slow_start = {
        **env,
        "GENFLEET_PORT": str(free_port()),
        "GENFLEET_EMULATOR_LOAD_S": "8",
        "GENFLEET_EMULATOR_TIME_SCALE": "1",
        "GENFLEET_HAND_BACK_MIN_START_S": "6",
    }
    ids = write_prompts(tmp_path / "prompts.jsonl", 75)
    settings = fault_settings(redis_url, store_url, **overrides)
    store = open_run_store(settings)
    restarting = start_worker(slow_start, name="restarting")
    restarting.wait_ready()
    # Still starting while the run is staged: every order goes to the first worker.
    roomy = start_worker({**env, "GENFLEET_PORT": str(free_port())}, name="roomy")
    stage(settings, run, tmp_path / "prompts.jsonl")
    held = wait_batch_running(redis_client, store, run, restarting.hostname, checkpointed=True)
    queue = worker_queue(settings)
    wait_for(lambda: queue_depth(redis_client, queue) == 0, 30, "every order taken")
    roomy.wait_ready()

    first = engine_pid(restarting)
    assert first is not None
    os.kill(first, signal.SIGKILL)
    killed_at = time.monotonic()
    cut = held - outputs(store, run)
    assert cut, "the batch finished before the kill"
    return SlowRestart(restarting, roomy, settings, store, ids, cut, killed_at)


def test_a_dead_engines_batches_finish_on_a_worker_with_room_while_it_restarts(
    tmp_path: Path,
    redis_url: str,
    redis_client: redis.Redis,
    start_worker: Callable[..., Worker],
) -> None:
    """No order waits (the run's last batches) and one worker's engine dies, its restart slow
    (a model's load): its running batches go back to the queue and the other worker, which
    has room, finishes them from the ids they drew. The first worker takes no order while
    its engine restarts, and takes orders again once it serves."""
    killed = kill_a_slow_engine_with_no_order_waiting(
        tmp_path, redis_url, redis_client, start_worker, "handback"
    )
    restarting, roomy, settings, store, ids, cut, killed_at = killed

    wait_for(lambda: cut <= outputs(store, "handback"), 60, f"{sorted(cut)} to finish", 0.1)
    moved_s = time.monotonic() - killed_at
    wait_run_done(settings, redis_client, "handback", 60, store)
    result, rows = assert_exactly_once(settings, "handback", ids, redis_client, store)
    assert result.errors == 0
    by_roomy = [
        row for row in rows if row["batch"] in cut and row["engine"]["worker"] == roomy.hostname
    ]
    assert by_roomy, "the cut batches waited for their own engine's restart"
    assert any(row.get("resumed_tokens") for row in by_roomy), "no answer went on from its ids"

    # Back and taking orders: with the other worker gone, a new run is done only by it.
    wait_engine_up(restarting.broker_url, restarting.hostname, restarts=1)
    roomy.stop()
    again = write_prompts(tmp_path / "again.jsonl", 50, prefix="again")
    stage(settings, "again", tmp_path / "again.jsonl")
    wait_run_done(settings, redis_client, "again", 60, store)
    result, rows = assert_exactly_once(settings, "again", again, redis_client, store)
    assert {row["engine"]["worker"] for row in rows} == {restarting.hostname}
    print(
        f"\n[fault hand-back] engine SIGKILLed with {sorted(cut)} running and no order waiting: "
        f"they finished on the other worker {moved_s:.1f} s later ({len(by_roomy)} answers, "
        f"{sum(1 for row in by_roomy if row.get('resumed_tokens'))} from their ids), before "
        f"the slow engine's restart (8-s load)"
    )


def test_a_dead_engines_batch_whose_answers_started_over_waits_for_it_with_their_account(
    tmp_path: Path,
    redis_url: str,
    redis_client: redis.Redis,
    start_worker: Callable[..., Worker],
) -> None:
    """With a repetition penalty the cut answers cannot go on from their ids: they start
    over, and their records say what that threw away, an account only the batch's own try
    holds. Such a batch is not handed back: it waits for its engine's restart."""
    killed = kill_a_slow_engine_with_no_order_waiting(
        tmp_path, redis_url, redis_client, start_worker, "penalty", repetition_penalty=1.1
    )
    restarting, _roomy, settings, store, ids, cut, _killed_at = killed
    wait_run_done(settings, redis_client, "penalty", 90, store)
    result, rows = assert_exactly_once(settings, "penalty", ids, redis_client, store)
    assert result.errors == 0
    restarted = [row for row in rows if row["batch"] in cut and row.get("restarted")]
    assert restarted, "no cut answer says it started over"
    assert {row["engine"]["worker"] for row in restarted} == {restarting.hostname}
    assert all(row["restarted"]["tokens"] > 0 for row in restarted)
