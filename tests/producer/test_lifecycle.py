"""`genfleet runs`, `cancel` and `delete` on real Redis, S3 (moto) and a real worker."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import orjson
import pytest
import redis
from typer.testing import CliRunner

from genfleet.cli import app
from genfleet.common import keys
from genfleet.common.redis_conn import text
from genfleet.common.settings import Settings
from genfleet.common.store import open_store
from genfleet.producer.runs.lifecycle import running_batches
from genfleet.producer.status import run_status
from harness.assertions import assert_exactly_once
from harness.env import base_env
from harness.processes import Worker
from harness.runs import outputs, wait_run_done
from harness.sources import write_prompts
from harness.waits import wait_for

pytestmark = [pytest.mark.integration, pytest.mark.slow]


def test_cancel_parks_running_batches_resume_finishes_and_delete_removes_everything(
    tmp_path: Path,
    redis_url: str,
    redis_client: redis.Redis,
    s3_server: str,
    s3_store_url: str,
    start_worker: Callable[..., Worker],
) -> None:
    # Real time: a batch of 20 prompts runs for seconds, so cancel catches some running.
    env = base_env(
        redis_url, s3_store_url, s3_endpoint_url=s3_server, emulator_time_scale=1, log_dir=tmp_path
    )
    worker = start_worker(env)
    settings = Settings(
        redis_url=redis_url, store=s3_store_url, s3_endpoint_url=s3_server, max_tokens=1024
    )
    flags = ["--redis-url", redis_url, "--store", s3_store_url, "--s3-endpoint-url", s3_server]

    def cli(*args: str, input: str | None = None) -> Any:
        return CliRunner().invoke(app, [*args, *flags], input=input)

    ids_a = write_prompts(tmp_path / "a.jsonl", 200, prefix="a")
    ids_b = write_prompts(tmp_path / "b.jsonl", 30, prefix="b")
    assert (
        cli("enqueue", str(tmp_path / "a.jsonl"), "--run", "a", "--batch-size", "20").exit_code == 0
    )
    worker.wait_ready()
    store = open_store(s3_store_url, s3_server)

    def midway() -> bool:
        counters = redis_client.hgetall(keys.counters_key("a"))
        generated = int(counters.get(b"prompts_generated", 0))
        in_outputs = 20 * len(outputs(store, "a"))
        return (
            bool(outputs(store, "a"))
            and generated > in_outputs + 3
            and bool(running_batches(redis_client, "a"))
        )

    wait_for(midway, 120, "a batch done and others running with finished prompts", 0.2)
    cancelled = cli("cancel", "a", "--json")
    assert cancelled.exit_code == 0, cancelled.output
    assert orjson.loads(cancelled.stdout)["running"]
    wait_for(lambda: not running_batches(redis_client, "a"), 30, "running batches to stop")
    done_at_cancel = outputs(store, "a")
    assert len(done_at_cancel) < 10
    assert list(store.list("a/parts/")), "the stopped batches checkpointed what finished"
    assert redis_client.llen("gpu.emulator") == 0  # its waiting orders are gone
    assert run_status(store, redis_client, "a")["state"] == "cancelled"

    # No batch of it starts again: another run goes through the same worker meanwhile.
    assert (
        cli("enqueue", str(tmp_path / "b.jsonl"), "--run", "b", "--batch-size", "10").exit_code == 0
    )
    wait_run_done(settings, redis_client, "b", 120, store)
    assert outputs(store, "a") == done_at_cancel
    assert not running_batches(redis_client, "a")

    listed = cli("runs", "--json")
    assert listed.exit_code == 0, listed.output
    rows = {row["run"]: row for row in orjson.loads(listed.stdout)}
    assert set(rows) == {"a", "b"}
    assert {k: rows["a"][k] for k in ("state", "model", "engine", "prompts", "done", "failed")} == {
        "state": "cancelled",
        "model": "emulator",
        "engine": "emulator",
        "prompts": 200,
        "done": 20 * len(done_at_cancel),
        "failed": 0,
    }
    assert (rows["b"]["state"], rows["b"]["done"]) == ("done", 30)
    assert isinstance(rows["a"]["created_at"], float)
    table = cli("runs")
    assert table.exit_code == 0 and "cancelled" in table.output and "emulator" in table.output

    # Resume: from the checkpoints, every prompt exactly once.
    resumed = cli("enqueue", "--resume", "a", "--json")
    assert resumed.exit_code == 0, resumed.output
    assert orjson.loads(resumed.stdout)["uncancelled"] is True
    wait_run_done(settings, redis_client, "a", 180, store)
    assert_exactly_once(settings, "a", ids_a, redis_client, store)

    # Delete asks first; "no" deletes nothing.
    refused = cli("delete", "a", input="n\n")
    assert refused.exit_code == 1, refused.output
    assert list(store.list("a/"))
    deleted = cli("delete", "a", "--yes", "--json")
    assert deleted.exit_code == 0, deleted.output
    assert orjson.loads(deleted.stdout)["objects"] > 0
    assert list(store.list("a/")) == []
    left = [text(k) for k in redis_client.keys("*") if ":a:" in text(k) or ".a." in text(k)]
    assert left == []
    assert b"a" not in redis_client.smembers(keys.runs_key())
    assert [row["run"] for row in orjson.loads(cli("runs", "--json").stdout)] == ["b"]
    assert cli("status", "a").exit_code == 2
    assert_exactly_once(settings, "b", ids_b, redis_client, store)
