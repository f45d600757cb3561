"""Orders that are not what they say never write a run: one naming another run's input, and a
late one of a deleted run whose producer's clock runs ahead. A real worker, real Redis, moto.
"""

from __future__ import annotations

import base64
from collections.abc import Callable
from pathlib import Path
from typing import Any

import orjson
import pytest
import redis

from genfleet.common import keys
from genfleet.common.celery_config import GENERATE_TASK
from genfleet.common.manifest import Manifest
from genfleet.common.records import decode_jsonl_gz
from genfleet.common.settings import Settings
from genfleet.common.store import Store, open_store
from genfleet.producer.broker import make_client_app
from genfleet.producer.enqueue import enqueue_run, reader_options
from genfleet.producer.runs.lifecycle import delete_run
from harness.env import base_env
from harness.processes import Worker
from harness.runs import wait_run_done
from harness.sources import write_prompts
from harness.waits import wait_for

pytestmark = pytest.mark.integration

QUEUE = "gpu.emulator"


def task_result(settings: Settings, task_id: str, timeout_s: float = 60) -> Any:
    """The task's state and result once the worker has finished it."""
    app = make_client_app(settings)
    result = app.AsyncResult(task_id)
    wait_for(result.ready, timeout_s, f"task {task_id} to finish", 0.1)
    return result.state, result.result


def setup(
    tmp_path: Path, redis_url: str, s3_server: str, s3_store_url: str
) -> tuple[Settings, Store, dict[str, str]]:
    env = base_env(redis_url, s3_store_url, s3_endpoint_url=s3_server, log_dir=tmp_path)
    settings = Settings(
        redis_url=redis_url, store=s3_store_url, s3_endpoint_url=s3_server, batch_size=50
    )
    return settings, open_store(s3_store_url, s3_server), env


def test_an_order_naming_another_runs_input_writes_nothing(
    tmp_path: Path,
    redis_url: str,
    redis_client: redis.Redis,
    s3_server: str,
    s3_store_url: str,
    start_worker: Callable[..., Worker],
) -> None:
    settings, store, env = setup(tmp_path, redis_url, s3_server, s3_store_url)
    write_prompts(tmp_path / "b.jsonl", 20)
    enqueue_run(settings, "b", str(tmp_path / "b.jsonl"), reader_options(settings))
    start_worker(env).wait_ready()
    wait_run_done(settings, redis_client, "b", 60, store)
    manifest = Manifest.load(store, "b")
    assert manifest is not None
    forged = {
        "run": "a",
        "batch": "batch-000000",
        "key": keys.input_key("b", "batch-000000"),  # run b's prompts, for run a
        "params": manifest.params.model_dump(),
        "model": "emulator",
        "engine": "emulator",
        "prompts": 20,
    }
    make_client_app(settings).send_task(
        GENERATE_TASK, kwargs={"order": forged}, queue=QUEUE, task_id="a.forged"
    )

    state, _ = task_result(settings, "a.forged")

    assert state == "FAILURE"
    assert not store.exists(keys.output_key("a", "batch-000000"))


def test_a_late_order_of_a_deleted_run_never_writes_the_run_staged_since(
    tmp_path: Path,
    redis_url: str,
    redis_client: redis.Redis,
    s3_server: str,
    s3_store_url: str,
    start_worker: Callable[..., Worker],
) -> None:
    settings, store, env = setup(tmp_path, redis_url, s3_server, s3_store_url)
    source = tmp_path / "x.jsonl"
    write_prompts(source, 20)
    enqueue_run(settings, "x", str(source), reader_options(settings))
    late = redis_client.lindex(QUEUE, 0)  # held back, as a worker's prefetch would hold it
    assert late is not None
    delete_run(settings, store, redis_client, "x", wait_s=5)
    again = settings.model_copy(update={"max_tokens": 64})
    enqueue_run(again, "x", str(source), reader_options(again))
    # The late copy comes back, stamped by a producer whose clock is an hour ahead.
    message = orjson.loads(late)
    args, kwargs, embed = orjson.loads(base64.b64decode(message["body"]))
    kwargs["order"]["enqueued_at"] += 3600
    message["body"] = base64.b64encode(orjson.dumps([args, kwargs, embed])).decode()
    redis_client.rpush(QUEUE, orjson.dumps(message))  # taken first
    start_worker(env).wait_ready()

    state, result = task_result(settings, message["headers"]["id"])

    assert state == "SUCCESS" and result.get("drop") is True, result
    wait_run_done(settings, redis_client, "x", 60, store)
    rows = [
        row
        for key in store.list(keys.outputs_prefix("x"))
        for row in decode_jsonl_gz(store.get(key) or b"")
    ]
    assert len(rows) == 20
    assert all(row["usage"]["completion_tokens"] <= 64 for row in rows)  # the new run's params
