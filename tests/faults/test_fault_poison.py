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
from tests.faults.helpers import (
    assert_exactly_once,
    fault_settings,
    open_run_store,
    outputs,
    stage,
    wait_run_done,
    write_prompts,
)
from tests.support import Worker, base_env, free_port, wait_for

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
    assert not redis_client.exists(keys.lease_key("poison", POISON))
    # Parked means parked: no copy of it is queued or running.
    assert not redis_client.sismember(keys.queued_key("poison"), POISON)
    assert not redis_client.hexists(keys.running_key(), f"poison/{POISON}")

    commands.retry("poison", redis_url=redis_url, store=store_url)
    wait_run_done(settings, redis_client, "poison", 120, store)
    assert_exactly_once(settings, "poison", ids, redis_client, store)
    assert not redis_client.hexists(keys.failed_key("poison"), POISON)
