"""An engine that stops answering without exiting: the stall watchdog kills its process
group, the supervisor restarts it, the in-flight prompts go on, and the run finishes with
every prompt exactly once. Two kinds of freeze: a hang that spins (the emulator's SIGUSR1: a
core busy, no token, no answer), judged by the window and the probe; and a stopped process
(SIGSTOP: no CPU time at all), judged by its CPU time within seconds."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import orjson
import pytest
import redis

from genfleet.common import keys
from genfleet.common.settings import Settings
from genfleet.common.store import Store
from genfleet.workers.engine.watchdog import CPU_STILL_S
from harness.assertions import assert_exactly_once
from harness.control import engine_report, wait_engine_up
from harness.env import base_env, free_port
from harness.processes import Worker, engine_pid, pid_alive
from harness.runs import (
    fault_settings,
    leases_of,
    open_run_store,
    outputs,
    stage,
    wait_batch_running,
    wait_run_done,
)
from harness.sources import write_prompts
from harness.waits import wait_for
from tests.support.chat_templates import checkpoint

pytestmark = [pytest.mark.fault, pytest.mark.integration, pytest.mark.slow]

STALL_TIMEOUT_S = 20


def stall_findings(client: redis.Redis) -> list[dict[str, object]]:
    rows = [orjson.loads(fields[b"finding"]) for _, fields in client.xrange(keys.findings_key())]
    return [row for row in rows if row["cause"] == "engine_stalled"]


def a_running_batch(
    tmp_path: Path,
    redis_url: str,
    redis_client: redis.Redis,
    start_worker: Callable[..., Worker],
    run: str,
    prompts: int,
    stall_timeout_s: float,
    **worker_settings: Any,
) -> tuple[Worker, list[str], Settings, Store]:
    """A worker with the stall watchdog at `stall_timeout_s`, running `run` (`prompts`
    prompts, checkpointed every second) once one of its batches runs."""
    store_url = (tmp_path / "store").as_uri()
    env = base_env(
        redis_url,
        store_url,
        log_dir=tmp_path,
        port=free_port(),
        checkpoint_interval_s=1,
        engine_stall_timeout_s=stall_timeout_s,
        **worker_settings,
    )
    worker = start_worker(env)
    ids = write_prompts(tmp_path / "prompts.jsonl", prompts)
    settings = fault_settings(redis_url, store_url)
    worker.wait_ready()
    store = open_run_store(settings)
    stage(settings, run, tmp_path / "prompts.jsonl")
    wait_batch_running(redis_client, store, run, worker.hostname)
    return worker, ids, settings, store


def test_frozen_engine_is_killed_restarted_and_the_run_finishes(
    tmp_path: Path,
    redis_url: str,
    redis_client: redis.Redis,
    start_worker: Callable[..., Worker],
) -> None:
    worker, ids, settings, store = a_running_batch(
        tmp_path, redis_url, redis_client, start_worker, "frozen", 150, STALL_TIMEOUT_S,
        emulator_time_scale=4,
    )  # fmt: skip
    frozen = engine_pid(worker)
    assert frozen is not None
    os.kill(frozen, signal.SIGUSR1)  # hangs, spinning: its CPU time still rises
    frozen_at = time.monotonic()
    try:
        assert outputs(store, "frozen") != set(keys.batch_id(i) for i in range(6))
        wait_for(lambda: not pid_alive(frozen), 90, f"the frozen engine (pid {frozen}) to die")
        killed_s = time.monotonic() - frozen_at
        wait_run_done(settings, redis_client, "frozen", 240 - (time.monotonic() - frozen_at))
        done_s = time.monotonic() - frozen_at
    finally:
        if pid_alive(frozen):
            os.kill(frozen, signal.SIGKILL)
    assert done_s < 240
    assert killed_s >= STALL_TIMEOUT_S  # not before the stall timeout
    result, _rows = assert_exactly_once(settings, "frozen", ids, redis_client, store)
    assert result.errors == 0
    assert worker.proc.poll() is None
    second = engine_pid(worker)
    assert second not in (None, frozen)
    restarts = wait_for(
        lambda: engine_report(worker.broker_url, worker.hostname).get("restarts"),
        20,
        "the worker's engine report",
    )
    assert restarts == 1
    found = stall_findings(redis_client)
    assert len(found) == 1 and found[0]["worker"] == worker.hostname
    numbers = found[0]["numbers"]
    assert isinstance(numbers, dict)
    assert numbers["stalled_s"] >= STALL_TIMEOUT_S and numbers["inflight"] > 0
    print(
        f"\n[fault frozen-engine] engine hung, spinning; killed {killed_s:.1f} s later (stall "
        f"timeout {STALL_TIMEOUT_S} s), run done {done_s:.1f} s after the freeze; finding "
        f"{numbers}"
    )


def test_an_engine_frozen_as_it_restarts_is_started_again_after_the_stall_window(
    tmp_path: Path,
    redis_url: str,
    redis_client: redis.Redis,
    start_worker: Callable[..., Worker],
) -> None:
    """The engine SIGKILLed mid-run, its successor SIGSTOPped while it loads: no health, no
    line, no CPU time. It is killed once it has not moved for the stall timeout (6 s) and
    another is started: not after the 60-s start timeout and the stop's SIGTERM grace."""
    worker, ids, settings, store = a_running_batch(
        tmp_path, redis_url, redis_client, start_worker, "restart", 150, 6,
        emulator_time_scale=4, emulator_load_s=3, startup_timeout_s=60,
    )  # fmt: skip
    first = engine_pid(worker)
    assert first is not None
    os.killpg(first, signal.SIGKILL)
    successor = wait_for(
        lambda: (pid := engine_pid(worker)) not in (None, first) and pid, 30, "a new engine"
    )
    os.kill(successor, signal.SIGSTOP)
    frozen_at = time.monotonic()
    try:
        wait_for(lambda: not pid_alive(successor), 60, "the frozen engine to be killed")
        killed_s = time.monotonic() - frozen_at
        wait_run_done(settings, redis_client, "restart", 120)
    finally:
        if pid_alive(successor):
            os.kill(successor, signal.SIGKILL)
    assert 5 <= killed_s < 20, killed_s
    result, _rows = assert_exactly_once(settings, "restart", ids, redis_client, store)
    assert result.errors == 0
    assert engine_pid(worker) not in (None, first, successor)
    print(f"\n[fault frozen-start] the restarting engine was frozen; killed {killed_s:.1f} s later")


def freeze_until_killed(
    worker: Worker, redis_client: redis.Redis, how: signal.Signals = signal.SIGUSR1
) -> tuple[float, dict[str, Any]]:
    """Freeze the worker's engine (`how`: SIGUSR1, a hang that spins; SIGSTOP, stopped); the
    seconds until the watchdog killed it, and the numbers of the stall finding it made."""
    frozen = engine_pid(worker)
    assert frozen is not None
    before = len(stall_findings(redis_client))
    os.kill(frozen, how)
    frozen_at = time.monotonic()
    try:
        wait_for(lambda: not pid_alive(frozen), 60, f"the frozen engine (pid {frozen}) to die")
        killed_s = time.monotonic() - frozen_at
    finally:
        if pid_alive(frozen):
            os.kill(frozen, signal.SIGKILL)
    found = wait_for(
        lambda: (rows := stall_findings(redis_client))[before:] and rows[before], 10, "a finding"
    )
    numbers = found["numbers"]
    assert isinstance(numbers, dict)
    return killed_s, numbers


def test_a_warm_engine_that_freezes_is_found_by_its_own_pauses_not_the_whole_timeout(
    tmp_path: Path,
    redis_url: str,
    redis_client: redis.Redis,
    start_worker: Callable[..., Worker],
) -> None:
    """An engine that has moved for a whole stall timeout gets a window of four times its
    longest pause, at least a quarter of the timeout: hung then (spinning: its CPU time says
    nothing), it is killed well before the timeout. Its successor, young, is judged by what
    the first one paused at most: hung seconds after it serves, it too is killed well before
    the timeout, not after all of it. The run ends exactly once."""
    stall_timeout_s = 24.0
    # A real engine's pace: 1,200 answers take about 100 s.
    worker, ids, settings, store = a_running_batch(
        tmp_path, redis_url, redis_client, start_worker, "warm", 1200, stall_timeout_s,
        emulator_time_scale=1, emulator_mean_completion_tokens=300,
    )  # fmt: skip
    time.sleep(stall_timeout_s + 4)  # busy all along: past its young minutes
    assert len(outputs(store, "warm")) < len(ids) // 25, "the run ended before the freeze"
    killed_s, numbers = freeze_until_killed(worker, redis_client)
    print(f"\n[fault warm-frozen-engine] killed {killed_s:.1f} s after the freeze: {numbers}")
    window_s = float(numbers["stall_window_s"])
    longest_s = float(numbers["longest_pause_s"])
    assert stall_timeout_s / 4 <= window_s < stall_timeout_s, numbers
    assert window_s == pytest.approx(max(stall_timeout_s / 4, 4 * longest_s), abs=0.3)
    # Killed once its window passed (counted from the last look that saw it move, up to a
    # look before the freeze), with a probe's and a look's slack; before, no sooner than the
    # whole timeout.
    assert window_s - 2 <= killed_s < window_s + 8, (killed_s, numbers)
    assert killed_s < stall_timeout_s, (killed_s, numbers)

    # The successor: up, then serving for a few seconds (young: under a stall timeout).
    wait_engine_up(worker.broker_url, worker.hostname, restarts=1)
    time.sleep(3)
    assert len(outputs(store, "warm")) < len(ids) // 25, "the run ended before the 2nd freeze"
    young_killed_s, young = freeze_until_killed(worker, redis_client)
    print(f"[fault warm-frozen-engine] its successor killed {young_killed_s:.1f} s after: {young}")
    assert young["learned_pause_s"] == pytest.approx(longest_s, abs=0.1), young
    young_window_s = float(young["stall_window_s"])
    assert young_window_s < stall_timeout_s, young
    assert young_killed_s < young_window_s + 8 and young_killed_s < stall_timeout_s, young
    wait_run_done(settings, redis_client, "warm", 240)
    result, _rows = assert_exactly_once(settings, "warm", ids, redis_client, store)
    assert result.errors == 0


def test_a_stopped_engine_is_killed_by_its_cpu_time_well_inside_its_window(
    tmp_path: Path,
    redis_url: str,
    redis_client: redis.Redis,
    start_worker: Callable[..., Worker],
) -> None:
    """SIGSTOP, requests in flight: no token and no CPU time. Killed about `CPU_STILL_S`
    after it stopped, with no probe waited out, where its young window is the whole 20-s
    timeout; restarted, and the run ends exactly once."""
    worker, ids, settings, store = a_running_batch(
        tmp_path, redis_url, redis_client, start_worker, "stopped", 150, STALL_TIMEOUT_S,
        emulator_time_scale=4,
    )  # fmt: skip
    killed_s, numbers = freeze_until_killed(worker, redis_client, signal.SIGSTOP)
    print(f"\n[fault stopped-engine] killed {killed_s:.1f} s after SIGSTOP: {numbers}")
    assert numbers["stall_window_s"] == STALL_TIMEOUT_S and numbers["inflight"] > 0, numbers
    cpu_still_s = numbers["cpu_still_s"]
    assert isinstance(cpu_still_s, float) and cpu_still_s >= CPU_STILL_S, numbers
    assert str(numbers["health"]).startswith("no CPU time"), numbers
    assert CPU_STILL_S <= killed_s < CPU_STILL_S + 4, (killed_s, numbers)
    wait_run_done(settings, redis_client, "stopped", 180)
    result, _rows = assert_exactly_once(settings, "stopped", ids, redis_client, store)
    assert result.errors == 0


def emulator_process(
    env: dict[str, str], port: int, log: Path, model: str
) -> subprocess.Popen[bytes]:
    """An emulator someone else runs (for `--engine external`), serving `model` as `ext` with
    Qwen3's reasoning parser (which the worker, reading no checkpoint, learns from the engine)."""
    argv = [sys.executable, "-m", "genfleet.workers.engine.emulator", "--model-path", model]
    argv += ["--served-model-name", "ext", "--port", str(port), "--enable-metrics"]
    argv += ["--reasoning-parser", "qwen3"]
    requests = {"GENFLEET_EMULATOR_REQUEST_LOG": str(log.with_suffix(".requests"))}
    return subprocess.Popen(
        argv,
        env={**env, **requests},
        stdout=log.open("ab"),
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )


def test_frozen_external_engine_stops_the_worker_consuming(
    tmp_path: Path,
    redis_url: str,
    redis_client: redis.Redis,
    start_worker: Callable[..., Worker],
) -> None:
    store_url = (tmp_path / "store").as_uri()
    env = base_env(redis_url, store_url, emulator_time_scale=4, checkpoint_interval_s=1)
    ports = [free_port(), free_port()]
    # Qwen3.5's published template opens the reasoning in the prompt: the answer's first
    # tokens are reasoning, which only the engine's parser says.
    model = checkpoint(tmp_path, "qwen3_5")
    engines = [
        emulator_process(env, port, tmp_path / f"external-{port}.log", model) for port in ports
    ]
    urls = [f"http://127.0.0.1:{port}" for port in ports]

    def external_worker(url: str, name: str) -> Worker:
        return start_worker(
            {
                **env,
                "GENFLEET_ENGINE": "external",
                "GENFLEET_ENGINE_URL": url,
                "GENFLEET_SERVED_MODEL_NAME": "ext",  # both engines serve one model: one queue
                "GENFLEET_ENGINE_HEALTH_PATH": "/health_generate",
                "GENFLEET_ENGINE_STALL_TIMEOUT_S": str(STALL_TIMEOUT_S / 2),
            },
            name=name,
        )

    try:
        watched = external_worker(urls[0], "external")
        ids = write_prompts(tmp_path / "prompts.jsonl", 100)
        # The sampling the engine's unread generation config would fill in, set by the run:
        # its answers are drawn by ids.
        settings = fault_settings(
            redis_url,
            store_url,
            engine="external",
            engine_url=urls[0],
            served_model_name="ext",
            top_k=-1,
            min_p=0.0,
            repetition_penalty=1.0,
        )
        watched.wait_ready()
        store = open_run_store(settings)
        stage(settings, "extfrozen", tmp_path / "prompts.jsonl")
        wait_for(
            lambda: leases_of(redis_client, "extfrozen", watched.hostname),
            60,
            "the worker to be running a batch",
            0.05,
        )
        from genfleet.workers.app import app

        def queues() -> list[str] | None:
            replies = app.control.inspect(destination=[watched.hostname], timeout=2).active_queues()
            if not replies or watched.hostname not in replies:
                return None
            return [q["name"] for q in replies[watched.hostname]]

        consumed = wait_for(queues, 30, "the worker's queues")
        os.kill(engines[0].pid, signal.SIGSTOP)
        wait_for(
            lambda: (q := queues()) is not None and not set(q) & set(consumed),
            120,
            f"the worker to stop consuming {consumed}",
        )
        assert stall_findings(redis_client)[0]["worker"] == watched.hostname
        healthy = external_worker(urls[1], "healthy")
        healthy.wait_ready()
        wait_run_done(settings, redis_client, "extfrozen", 120, store)
        _, rows = assert_exactly_once(settings, "extfrozen", ids, redis_client, store)
        # Drawn by ids, split as the engine's own parser splits a chat answer.
        assert all(row["reasoning"] and "think>" not in row["content"] for row in rows)
        logged = (tmp_path / f"external-{ports[1]}.requests").read_text().splitlines()
        assert {json.loads(line).get("endpoint") for line in logged} == {"/generate", None}
    finally:
        for engine in engines:
            os.killpg(engine.pid, signal.SIGKILL)
            engine.wait(timeout=10)
