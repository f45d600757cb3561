"""A dataset goes from a file through Redis and a supervised engine into the store, and out.

Real Redis, real Celery worker processes, the emulator started by the real supervisor, a real
S3 protocol server (moto) for s3:// stores.
"""

from __future__ import annotations

import gzip
from collections.abc import Callable
from pathlib import Path

import orjson
import pytest
import redis
from typer.testing import CliRunner

from genfleet.common import keys
from genfleet.common.settings import Settings
from genfleet.common.store import open_store
from genfleet.producer.enqueue import enqueue_run, reader_options
from genfleet.producer.export import export_run
from genfleet.producer.status import run_status
from harness.env import base_env
from harness.processes import Worker
from harness.waits import wait_for

pytestmark = [pytest.mark.integration, pytest.mark.slow]


def write_prompts(path: Path, count: int) -> list[str]:
    ids = [f"q{i:05d}" for i in range(count)]
    with path.open("wb") as handle:
        for i, prompt_id in enumerate(ids):
            if i % 2:
                row = {"id": prompt_id, "prompt": f"Question {i}: what is {i} + {i}?"}
            else:
                row = {"id": prompt_id, "messages": [{"role": "user", "content": f"Say {i}."}]}
            handle.write(orjson.dumps(row) + b"\n")
    return ids


def settings_for(redis_url: str, store: str, endpoint: str | None = None) -> Settings:
    return Settings(
        redis_url=redis_url, store=store, s3_endpoint_url=endpoint, batch_size=100, max_tokens=1024
    )


@pytest.mark.parametrize("backend", ["file", "s3"])
def test_thousand_prompts_round_trip(
    backend: str,
    tmp_path: Path,
    redis_url: str,
    redis_client: redis.Redis,
    start_worker: Callable[..., Worker],
    request: pytest.FixtureRequest,
) -> None:
    endpoint = None
    if backend == "s3":
        endpoint = request.getfixturevalue("s3_server")
        store_url = request.getfixturevalue("s3_store_url")
    else:
        store_url = (tmp_path / "store").as_uri()
    ids = write_prompts(tmp_path / "prompts.jsonl", 1000)
    extra = {"s3_endpoint_url": endpoint} if endpoint else {}
    worker = start_worker(base_env(redis_url, store_url, **extra))
    settings = settings_for(redis_url, store_url, endpoint)

    result = enqueue_run(settings, "e2e", str(tmp_path / "prompts.jsonl"), reader_options(settings))
    assert (result.prompts, result.batches_total, result.batches_enqueued) == (1000, 10, 10)
    worker.wait_ready()

    store = open_store(store_url, endpoint)
    report = wait_for(
        lambda: (r := run_status(store, redis_client, "e2e"))["state"] == "done" and r,
        180,
        "run e2e to finish",
        0.5,
    )
    assert report["prompts_done"] == 1000
    assert report["completion_tokens"] > 0

    out = tmp_path / "out.jsonl"
    export_run(settings, "e2e", str(out), "jsonl", False)
    rows = [orjson.loads(line) for line in out.read_bytes().splitlines()]
    assert [row["id"] for row in rows] == ids
    first = rows[0]
    assert first["run"] == "e2e" and first["batch"] == "batch-000000"
    assert first["engine"]["kind"] == "emulator"
    assert first["error"] is None
    assert first["content"] and first["reasoning"]
    assert first["usage"]["completion_tokens"] >= first["usage"]["reasoning_tokens"] > 0
    assert first["finish_reason"] in {"stop", "length"}

    # Re-running enqueue for a finished run enqueues nothing new.
    again = enqueue_run(settings, "e2e", str(tmp_path / "prompts.jsonl"), reader_options(settings))
    assert (again.batches_enqueued, again.batches_done, again.staged) == (0, 10, False)


def test_bad_lines_are_rejected_and_the_rest_runs(
    tmp_path: Path, redis_url: str, redis_client: redis.Redis, start_worker: Callable[..., Worker]
) -> None:
    source = tmp_path / "mixed.jsonl"
    source.write_bytes(
        b'{"id": "a", "prompt": "fine"}\n'
        b"not json at all\n"
        b'{"id": "b"}\n'
        b'{"id": "c", "messages": []}\n'
        b'{"id": "d", "messages": "hello"}\n'
        b'{"id": "a", "prompt": "duplicate id"}\n'
        b'{"prompt": "no id is fine"}\n'
    )
    store_url = (tmp_path / "store").as_uri()
    worker = start_worker(base_env(redis_url, store_url))
    runner = CliRunner()
    from genfleet.cli import app

    result = runner.invoke(
        app,
        ["enqueue", str(source), "--run", "mixed", "--redis-url", redis_url, "--store", store_url],
    )
    assert result.exit_code == 0, result.output
    assert "rejected 5 lines" in " ".join(result.output.split())  # rich wraps at 80
    store = open_store(store_url)
    rejects = [
        orjson.loads(line) for line in (store.get(keys.rejects_key("mixed")) or b"").splitlines()
    ]
    assert [(r["line"], r["field"]) for r in rejects] == [
        (2, None),
        (3, "messages"),
        (4, "messages"),
        (5, "messages"),
        (6, "id"),
    ]
    assert all(r["file"] == str(source) for r in rejects)
    worker.wait_ready()
    wait_for(
        lambda: run_status(store, redis_client, "mixed")["state"] == "done", 60, "run mixed", 0.3
    )
    data = store.get(keys.output_key("mixed", "batch-000000"))
    assert data is not None
    ids = [orjson.loads(line)["id"] for line in gzip.decompress(data).splitlines()]
    assert ids == ["a", "mixed.jsonl:7"]


def test_file_with_no_valid_line_exits_non_zero(tmp_path: Path, redis_url: str) -> None:
    source = tmp_path / "bad.jsonl"
    source.write_bytes(b'nope\n{"x": 1}\n')
    from genfleet.cli import app

    result = CliRunner().invoke(
        app,
        [
            "enqueue",
            str(source),
            "--run",
            "bad",
            "--redis-url",
            redis_url,
            "--store",
            (tmp_path / "s").as_uri(),
        ],
    )
    assert result.exit_code == 2
    assert "no valid prompt" in result.output
    assert "bad.jsonl:1" in result.output.replace("\n", "")


def test_status_moves_while_a_batch_runs(
    tmp_path: Path,
    redis_url: str,
    redis_client: redis.Redis,
    start_worker: Callable[..., Worker],
) -> None:
    store_url = (tmp_path / "store").as_uri()
    worker = start_worker(base_env(redis_url, store_url, emulator_time_scale=1))
    settings = settings_for(redis_url, store_url)
    source = tmp_path / "one-batch.jsonl"
    write_prompts(source, 100)
    enqueue_run(
        settings.model_copy(update={"batch_size": 100}),
        "live",
        str(source),
        reader_options(settings),
    )
    worker.wait_ready()
    store = open_store(store_url)
    live = wait_for(
        lambda: (r := run_status(store, redis_client, "live"))["prompts_generated"] > 0 and r,
        60,
        "progress from the running batch",
        0.2,
    )
    # the one batch is still running: nothing is in the store yet, but status moves
    assert live["state"] == "running" and live["batches_done"] == 0
    assert 0 < live["prompts_generated"] < 100 and live["prompts_done"] == 0
    assert live["tokens_per_s"] > 0 and live["eta_s"] is not None and live["eta_s"] > 0
    done = wait_for(
        lambda: (r := run_status(store, redis_client, "live"))["state"] == "done" and r, 120, "done"
    )
    assert done["prompts_generated"] == done["prompts_done"] == 100
