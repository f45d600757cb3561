"""A store call that hangs longer than the lease: the lease is kept by its own heartbeat, so
the reaper never hands the batch to a second worker, and the batch runs once."""

from __future__ import annotations

import collections
import re
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import redis

from genfleet.common import keys
from harness.assertions import assert_exactly_once
from harness.env import free_port
from harness.processes import Worker
from harness.runs import leases_of, outputs, stage, wait_batch_running, wait_run_done
from harness.services import FlakyS3
from harness.sources import write_prompts
from harness.waits import wait_for

pytestmark = [pytest.mark.fault, pytest.mark.integration, pytest.mark.slow]

LEASE_S = 4.0
HANG_S = 3 * LEASE_S


def runs_per_batch(workers: list[Worker]) -> collections.Counter[str]:
    """How many times each batch was run to the end (task results in the workers' logs)."""
    counts: collections.Counter[str] = collections.Counter()
    for worker in workers:
        text = worker.log.read_text(errors="replace")
        counts.update(re.findall(r"\] succeeded .*'batch': '(batch-\d+)'.*'skipped': False", text))
    return counts


def test_store_hanging_longer_than_the_lease_does_not_run_a_batch_twice(
    tmp_path: Path,
    redis_url: str,
    redis_client: redis.Redis,
    start_worker: Callable[..., Worker],
    flaky_s3: FlakyS3,
) -> None:
    env = flaky_s3.worker_env(
        redis_url,
        lease_ttl_s=LEASE_S,
        reaper_interval_s=1,
        emulator_time_scale=4,
        checkpoint_interval_s=1,
        log_dir=tmp_path,
    )
    control = start_worker(env, role="control")
    workers = [start_worker({**env, "GENFLEET_PORT": str(free_port())}) for _ in range(2)]
    ids = write_prompts(tmp_path / "prompts.jsonl", 150)
    direct, store = flaky_s3.settings(redis_url, direct=True), flaky_s3.store()
    for worker in (control, *workers):
        worker.wait_ready()
    stage(flaky_s3.settings(redis_url), "hang", tmp_path / "prompts.jsonl")

    # Batches past their store reads: leased (the lease comes first), no output, and a
    # checkpoint part written, so their only store calls left are puts.
    running = wait_batch_running(redis_client, store, "hang", checkpointed=True)

    flaky_s3.proxy.hang()
    hung_at = time.monotonic()
    try:
        while time.monotonic() - hung_at < HANG_S:
            # Nothing can reach the store, so nothing finishes: every lease held stays held.
            lapsed = running - leases_of(redis_client, "hang") - outputs(store, "hang")
            assert not lapsed, f"leases lapsed on live workers during the hang: {lapsed}"
            time.sleep(0.2)
    finally:
        flaky_s3.proxy.flow()
    wait_run_done(direct, redis_client, "hang", 180, store)
    result, _rows = assert_exactly_once(direct, "hang", ids, redis_client, store)
    assert result.errors == 0
    assert flaky_s3.proxy.held > 0, "no store call felt the hang"
    # No lease expired without output (the reaper handed nothing to a second worker) ...
    assert not redis_client.hgetall(keys.lost_key("hang"))
    # ... and each batch ran to the end once: Celery's result line of every generate_batch
    # that did not skip its batch, in the workers' logs.
    runs = wait_for(
        lambda: r if len(r := runs_per_batch(workers)) == 6 else None,
        20,
        "every batch's result in the logs",
    )
    assert set(runs.values()) == {1}, f"batches run more than once: {runs}"
    # A hung put cost no try (checkpoint rows were kept for later, the output put was tried
    # again): the batches running when the store hung, whose only store calls were puts, have
    # no failed try. Only batches starting in the hang (their input read failed, nothing
    # generated yet) were tried again.
    tried = {k.decode() for k in redis_client.hgetall(keys.attempts_key("hang"))}
    assert not tried & running, f"a hung put cost a try: {sorted(tried & running)}"


SLOW_LEASE_S = 2.0
# Each answer chunk of the store held this long: under the workers' read timeout (1 s, the
# floor for a lease this short), but a batch's first store reads (output, input, parts) take
# longer together than the lease.
SLOW_REPLY_S = 0.7


def test_slow_store_reads_do_not_let_the_reaper_take_a_live_batch(
    tmp_path: Path,
    redis_url: str,
    redis_client: redis.Redis,
    start_worker: Callable[..., Worker],
    flaky_s3: FlakyS3,
) -> None:
    env = flaky_s3.worker_env(
        redis_url,
        lease_ttl_s=SLOW_LEASE_S,
        reaper_interval_s=0.5,
        checkpoint_interval_s=30,
        log_dir=tmp_path,
    )
    control = start_worker(env, role="control")
    worker = start_worker({**env, "GENFLEET_PORT": str(free_port())})
    ids = write_prompts(tmp_path / "prompts.jsonl", 50)
    # Staged at full speed, straight to the store: only the worker's calls are slow.
    direct, store = flaky_s3.settings(redis_url, direct=True), flaky_s3.store()
    for each in (control, worker):
        each.wait_ready()
    flaky_s3.proxy.slow(SLOW_REPLY_S)
    stage(direct, "slow", tmp_path / "prompts.jsonl")
    wait_run_done(direct, redis_client, "slow", 120, store)
    flaky_s3.proxy.slow(0)  # full speed again: the worker's shutdown takes no half minute
    result, _rows = assert_exactly_once(direct, "slow", ids, redis_client, store)
    assert result.errors == 0
    assert flaky_s3.proxy.delayed > 0, "no store answer was slowed"
    # No batch was taken from its live worker: none lost, none re-enqueued, each run once.
    assert not redis_client.hgetall(keys.lost_key("slow"))
    runs = wait_for(
        lambda: r if len(r := runs_per_batch([worker])) == 2 else None,
        20,
        "every batch's result in the log",
    )
    assert set(runs.values()) == {1}, f"batches run more than once: {runs}"
