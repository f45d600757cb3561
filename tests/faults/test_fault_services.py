"""Services failing under a run: Redis restarted or wiped, S3 unreachable for a while.

Each test owns the service it breaks (a private redis-server, a moto server behind a proxy)
and ends with `assert_exactly_once`.
"""

from __future__ import annotations

import base64
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import orjson
import pytest
import redis
from typer.testing import CliRunner

from genfleet.common import keys
from harness.assertions import assert_counters_backed, assert_exactly_once
from harness.env import base_env, free_port
from harness.processes import Worker
from harness.runs import fault_settings, open_run_store, outputs, stage, wait_run_done
from harness.services import FlakyS3, RedisServer
from harness.sources import write_prompts
from harness.waits import wait_for

pytestmark = [pytest.mark.fault, pytest.mark.integration, pytest.mark.slow]


def queued_batches(client: redis.Redis, run: str, queue: str = "gpu.emulator") -> list[str]:
    """The batches of `run` whose work orders wait in `queue` (kombu's Redis list)."""
    batches = []
    for raw in client.lrange(queue, 0, -1):
        message = orjson.loads(raw)
        body = orjson.loads(base64.b64decode(message["body"]))
        order = body[1]["order"]  # [args, kwargs, embed]
        if order["run"] == run:
            batches.append(order["batch"])
    return sorted(batches)


def every_batch(count: int) -> list[str]:
    return [keys.batch_id(i) for i in range(count)]


def resume(redis_url: str, store_url: str, run: str) -> dict[str, Any]:
    """`genfleet enqueue --resume RUN --json`, as a user would type it."""
    from genfleet.cli import app

    result = CliRunner().invoke(
        app,
        ["enqueue", "--resume", run, "--redis-url", redis_url, "--store", store_url, "--json"],
    )
    assert result.exit_code == 0, result.output
    report: dict[str, Any] = orjson.loads(result.stdout)
    return report


def test_queue_survives_a_redis_restart_and_resume_rebuilds_it_after_flushall(
    tmp_path: Path,
    private_redis: RedisServer,
    start_worker: Callable[..., Worker],
) -> None:
    url = private_redis.url
    store_url = (tmp_path / "store").as_uri()
    client = private_redis.client()
    settings = fault_settings(url, store_url)

    # 1. Work orders queued with no worker running survive SHUTDOWN and a restart (AOF).
    ids = write_prompts(tmp_path / "queued.jsonl", 200)
    staged = stage(settings, "queued", tmp_path / "queued.jsonl")
    every = every_batch(staged.batches_total)
    assert queued_batches(client, "queued") == every
    client.close()
    restarted_at = time.monotonic()
    private_redis.restart()
    restart_s = time.monotonic() - restarted_at
    client = private_redis.client()
    assert queued_batches(client, "queued") == every
    worker = start_worker(base_env(url, store_url, log_dir=tmp_path, port=free_port()))
    worker.wait_ready()
    wait_run_done(settings, client, "queued", 60)
    assert_exactly_once(settings, "queued", ids, client)
    worker.stop()
    assert private_redis.password not in worker.log.read_text(errors="replace")

    # 2. Redis loses everything mid-run: `enqueue --resume` sends exactly the missing batches.
    # Enough batches that some are still queued when the warm shutdown ends, on a slow machine
    # too (a shutdown under load can outlast a dozen batches of this emulator).
    ids = write_prompts(tmp_path / "flushed.jsonl", 600, prefix="f")
    slow = base_env(url, store_url, log_dir=tmp_path, port=free_port(), emulator_time_scale=4)
    worker = start_worker(slow)
    worker.wait_ready()
    staged = stage(settings, "flushed", tmp_path / "flushed.jsonl")
    store = open_run_store(settings)
    wait_for(lambda: len(outputs(store, "flushed")) >= 3, 60, "a few batches to finish", 0.1)
    worker.stop()  # warm shutdown: running batches finish, the rest stay queued
    assert not client.hgetall(keys.attempts_key("flushed")), "warm shutdown broke a batch"
    done = outputs(store, "flushed")
    missing = sorted(set(every_batch(staged.batches_total)) - done)
    assert missing, "the run finished before Redis was wiped: nothing to resume"
    client.flushall()
    report = resume(url, store_url, "flushed")
    assert report["batches_enqueued"] == len(missing)
    assert report["batches_done"] == len(done)
    assert queued_batches(client, "flushed") == missing
    worker = start_worker({**slow, "GENFLEET_EMULATOR_TIME_SCALE": "200"})
    worker.wait_ready()
    wait_run_done(settings, client, "flushed", 90, store)
    result, _rows = assert_exactly_once(settings, "flushed", ids, client, store)
    client.close()
    print(
        f"\n[fault redis] {len(every)} orders survived SHUTDOWN + restart ({restart_s:.1f} s); "
        f"after FLUSHALL with {len(done)}/{staged.batches_total} batches done, --resume "
        f"enqueued {report['batches_enqueued']} (= the {len(missing)} without output); "
        f"{result.records} records"
    )


# Inside what the store's own retries ride out (six tries, backoff 0.5 s doubling, each try
# with botocore's own retries: about half a minute), so the outcome does not depend on timing.
OUTAGE_S = 10.0


def test_s3_outage_is_ridden_out_with_retries(
    tmp_path: Path,
    redis_url: str,
    redis_client: redis.Redis,
    start_worker: Callable[..., Worker],
    flaky_s3: FlakyS3,
) -> None:
    env = flaky_s3.worker_env(
        redis_url,
        emulator_time_scale=4,
        checkpoint_interval_s=1,
        log_dir=tmp_path,
        port=free_port(),
    )
    worker = start_worker(env)
    ids = write_prompts(tmp_path / "prompts.jsonl", 250)
    # The test's own view of the bucket goes around the proxy, so it sees through the outage.
    direct, store = flaky_s3.settings(redis_url, direct=True), flaky_s3.store()
    staged = stage(flaky_s3.settings(redis_url), "s3outage", tmp_path / "prompts.jsonl")
    worker.wait_ready()
    wait_for(lambda: outputs(store, "s3outage"), 60, "the first batch to finish", 0.1)

    flaky_s3.proxy.cut()
    cut_at = time.monotonic()
    done_before = len(outputs(store, "s3outage"))
    while time.monotonic() - cut_at < OUTAGE_S:  # the outage itself, checked all along
        assert_counters_backed(redis_client, store, "s3outage")
        time.sleep(0.2)
    assert flaky_s3.proxy.refused > 0, "nothing tried to reach S3 during the outage"
    assert len(outputs(store, "s3outage")) == done_before
    flaky_s3.proxy.restore()

    def finished() -> bool:
        assert_counters_backed(redis_client, store, "s3outage")
        return len(outputs(store, "s3outage")) == staged.batches_total

    wait_for(finished, 120, "the run to finish after S3 came back", 0.2)
    recovered_s = time.monotonic() - cut_at - OUTAGE_S
    wait_run_done(direct, redis_client, "s3outage", 30, store)
    result, _rows = assert_exactly_once(direct, "s3outage", ids, redis_client, store)
    assert result.errors == 0
    assert not redis_client.hgetall(keys.failed_key("s3outage"))
    assert worker.proc.poll() is None
    tries = redis_client.hgetall(keys.attempts_key("s3outage"))
    batch_retries = sum(int(n) for n in tries.values())
    print(
        f"\n[fault s3] {OUTAGE_S:.0f} s outage with {done_before}/{staged.batches_total} batches "
        f"done; {flaky_s3.proxy.refused} connections refused; {batch_retries} batch-level "
        f"retries; run done {recovered_s:.1f} s after S3 came back; {result.records} records"
    )
