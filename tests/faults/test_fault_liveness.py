"""A worker SIGKILLed is known dead at once: Redis drops its named connection
(workers/observe/liveness.py). Its running batches go back without waiting for their leases, and the
orders it had received and not claimed yet (no lease, no running entry: only the broker's
unacked copy, delivered again after hours) go back too."""

from __future__ import annotations

import signal
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import redis

from genfleet.common.ledger import Ledger
from harness.assertions import assert_exactly_once
from harness.env import base_env, free_port
from harness.processes import Worker
from harness.runs import (
    fault_settings,
    leases_of,
    open_run_store,
    outputs,
    reaped,
    stage,
    wait_run_done,
)
from harness.services import FlakyS3
from harness.sources import write_prompts
from harness.waits import wait_for

pytestmark = [pytest.mark.fault, pytest.mark.integration, pytest.mark.slow]

LEASE_S = 20.0  # long: what is measured is how much sooner than this the batches go back


def test_a_killed_workers_batches_go_back_before_their_leases_lapse(
    tmp_path: Path,
    redis_url: str,
    redis_client: redis.Redis,
    start_worker: Callable[..., Worker],
) -> None:
    store_url = (tmp_path / "store").as_uri()
    env = base_env(
        redis_url,
        store_url,
        lease_ttl_s=LEASE_S,
        reaper_interval_s=0.5,
        emulator_time_scale=2,
        log_dir=tmp_path,
    )
    control = start_worker(env, role="control")
    doomed = start_worker({**env, "GENFLEET_PORT": str(free_port())}, name="doomed")
    ids = write_prompts(tmp_path / "prompts.jsonl", 100)
    settings = fault_settings(redis_url, store_url)
    control.wait_ready()
    doomed.wait_ready()
    store = open_run_store(settings)
    stage(settings, "gone", tmp_path / "prompts.jsonl")
    held = wait_for(lambda: leases_of(redis_client, "gone", doomed.hostname), 60, "batches", 0.05)
    doomed.kill(signal.SIGKILL)
    killed_at = time.monotonic()
    doomed.proc.wait(timeout=10)
    lost = held - outputs(store, "gone")
    assert lost, "the batches finished before the kill"

    def back() -> bool:
        return {f"gone/{batch}" for batch in lost} <= set(reaped(redis_client, "gone"))

    wait_for(back, LEASE_S, "the killed worker's batches to be re-enqueued", 0.2)
    back_s = time.monotonic() - killed_at
    # Its leases still ran: half a lease to confirm it is gone, and the reaper's beat.
    assert back_s < LEASE_S * 0.75, back_s
    survivor = start_worker({**env, "GENFLEET_PORT": str(free_port())}, name="survivor")
    survivor.wait_ready()
    wait_run_done(settings, redis_client, "gone", 120, store)
    assert_exactly_once(settings, "gone", ids, redis_client, store)
    print(f"\n[fault liveness] batches re-enqueued {back_s:.1f} s after the kill (lease {LEASE_S})")


def test_orders_a_killed_worker_never_claimed_go_back_to_the_queue(
    tmp_path: Path,
    redis_url: str,
    redis_client: redis.Redis,
    start_worker: Callable[..., Worker],
    flaky_s3: FlakyS3,
) -> None:
    """The store hangs: the worker has received the orders and its admission waits on a store
    read, before any claim. Killed there, its orders are only in the broker's unacked hash,
    which delivers them again after the visibility timeout (hours); they go back now."""
    direct = {"s3_endpoint_url": flaky_s3.direct_url, "lease_ttl_s": 4, "reaper_interval_s": 0.5}
    env = base_env(redis_url, flaky_s3.store_url, log_dir=tmp_path, **direct)
    control = start_worker(env, role="control")
    hung = {**env, "GENFLEET_S3_ENDPOINT_URL": flaky_s3.endpoint_url}
    doomed = start_worker({**hung, "GENFLEET_PORT": str(free_port())}, name="doomed")
    ids = write_prompts(tmp_path / "prompts.jsonl", 50)
    settings = fault_settings(redis_url, flaky_s3.store_url, s3_endpoint_url=flaky_s3.direct_url)
    control.wait_ready()
    doomed.wait_ready()
    flaky_s3.proxy.hang()
    stage(settings, "unclaimed", tmp_path / "prompts.jsonl")
    ledger = Ledger(redis_client)

    def received() -> bool:
        delivered = [u for u in ledger.unacked_orders() if u.run == "unclaimed"]
        return len(delivered) == 2 and not ledger.running_batches("unclaimed")

    wait_for(received, 30, "both orders received and not claimed", 0.05)
    doomed.kill(signal.SIGKILL)
    doomed.proc.wait(timeout=10)
    flaky_s3.proxy.flow()
    survivor = start_worker({**env, "GENFLEET_PORT": str(free_port())}, name="survivor")
    survivor.wait_ready()
    store = open_run_store(settings)
    wait_run_done(settings, redis_client, "unclaimed", 60, store)
    assert_exactly_once(settings, "unclaimed", ids, redis_client, store)
