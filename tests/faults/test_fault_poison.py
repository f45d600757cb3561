"""A batch that kills its worker every time it runs: after `max_deliveries` (3) it is parked in
the failed set instead of travelling the fleet forever; the rest of the run finishes, and
`genfleet retry` can still resend it."""

from __future__ import annotations

import time
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
from harness.runs import fault_settings, open_run_store, outputs, stage, wait_run_done
from harness.sources import write_prompts
from harness.waits import wait_for

pytestmark = [pytest.mark.fault, pytest.mark.integration, pytest.mark.slow]

POISON = keys.batch_id(1)


def test_batch_that_kills_its_worker_is_parked_after_three_deliveries(
    tmp_path: Path,
    redis_url: str,
    redis_client: redis.Redis,
    start_worker: Callable[..., Worker],
) -> None:
    store_url = (tmp_path / "store").as_uri()
    # One batch at a time per worker, so a kill only ever interrupts the poison batch.
    env = base_env(
        redis_url,
        store_url,
        lease_ttl_s=3,
        reaper_interval_s=1,
        emulator_time_scale=4,
        worker_concurrency=1,
        log_dir=tmp_path,
    )
    start_worker(env, role="control").wait_ready()

    def gpu_worker() -> Worker:
        return start_worker({**env, "GENFLEET_PORT": str(free_port())}, name="gpu")

    workers = [gpu_worker(), gpu_worker()]
    for worker in workers:
        worker.wait_ready()
    ids = write_prompts(tmp_path / "prompts.jsonl", 125)
    settings = fault_settings(redis_url, store_url)
    store = open_run_store(settings)
    stage(settings, "poison", tmp_path / "prompts.jsonl")
    lease = keys.lease_key("poison", POISON)

    kills = 0
    deadline = time.monotonic() + 240
    while not redis_client.hexists(keys.failed_key("poison"), POISON):
        assert time.monotonic() < deadline, f"{POISON} never parked after {kills} kills"
        holder = redis_client.get(lease)
        victim = next((w for w in workers if holder and w.hostname == text(holder)), None)
        if victim is not None and victim.proc.poll() is None:
            victim.kill()  # the batch "crashes" whichever worker runs it
            victim.proc.wait(timeout=10)
            kills += 1
            workers.remove(victim)
            workers.append(gpu_worker())
        time.sleep(0.05)
    assert kills == 3
    reason = text(redis_client.hget(keys.failed_key("poison"), POISON))
    assert "poison batch" in reason and "3 deliveries" in reason
    others = {keys.batch_id(i) for i in range(5)} - {POISON}
    wait_for(lambda: others <= outputs(store, "poison"), 120, "the other batches", 0.2)
    assert POISON not in outputs(store, "poison")
    # The last worker it killed held its lease: gone by its TTL (3 s), not renewed by anyone.
    lease = keys.lease_key("poison", POISON)
    wait_for(lambda: not redis_client.exists(lease), 10, "the parked batch's lease to lapse", 0.2)
    # Parked means parked: no copy of it is queued or running.
    assert not redis_client.sismember(keys.queued_key("poison"), POISON)
    assert not redis_client.hexists(keys.running_key(), f"poison/{POISON}")

    commands.retry("poison", redis_url=redis_url, store=store_url)
    wait_run_done(settings, redis_client, "poison", 120, store)
    assert_exactly_once(settings, "poison", ids, redis_client, store)
    assert not redis_client.hexists(keys.failed_key("poison"), POISON)


POISON_PROMPT = "POISON-PROMPT"


def consuming(hostnames: list[str]) -> set[str]:
    """Which of `hostnames` consume the emulator's work queue now."""
    from genfleet.workers.app import app

    replies = app.control.inspect(destination=hostnames, timeout=2).active_queues() or {}
    return {w for w, queues in replies.items() if any(q["name"] == "gpu.emulator" for q in queues)}


def test_a_prompt_that_crashes_the_engine_costs_one_record_and_no_worker(
    tmp_path: Path,
    redis_url: str,
    redis_client: redis.Redis,
    start_worker: Callable[..., Worker],
) -> None:
    """Two workers whose engines exit whenever they receive one particular prompt: that
    prompt becomes an error record naming the crash, every other prompt is answered, and both
    workers still consume. (It used to be re-sent after every restart until each worker's
    budget was spent and both stopped consuming, with the run stuck half done.)"""
    store_url = (tmp_path / "store").as_uri()
    env = base_env(
        redis_url,
        store_url,
        engine_extra_args=f"--emulator-crash-on-prompt {POISON_PROMPT}",
        log_dir=tmp_path,
    )
    workers = [start_worker({**env, "GENFLEET_PORT": str(free_port())}) for _ in range(2)]
    for worker in workers:
        worker.wait_ready()
    poison = 57
    source = tmp_path / "prompts.jsonl"
    ids = write_prompts(source, 200, marked={poison: f"{POISON_PROMPT}: what is 1 + 1?"})
    settings = fault_settings(redis_url, store_url, batch_size=50)
    store = open_run_store(settings)
    stage(settings, "crasher", source)
    wait_run_done(settings, redis_client, "crasher", 90, store)

    _result, rows = assert_exactly_once(settings, "crasher", ids, redis_client, store)
    errors = [row for row in rows if row["error"] is not None]
    assert [row["id"] for row in errors] == [ids[poison]]
    assert errors[0]["error"]["type"] == "engine_crash"
    assert "emulated crash" in errors[0]["error"]["message"]  # the crash, by its last line
    assert not redis_client.hgetall(keys.failed_key("crasher"))
    hostnames = [w.hostname for w in workers]
    assert consuming(hostnames) == set(hostnames)
