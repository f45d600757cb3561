"""Bad work: a poison batch, prompts the engine refuses, a pickled message on the queue.

Each test runs a real worker process and ends with `assert_exactly_once`.
"""

from __future__ import annotations

import json
import re
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import redis
from celery import Celery

from genfleet.common import keys
from genfleet.common.celery_config import GENERATE_TASK
from genfleet.common.settings import Settings
from harness.assertions import assert_exactly_once
from harness.env import base_env
from harness.processes import Worker
from harness.runs import fault_settings, open_run_store, stage, wait_run_done
from harness.sources import write_prompts
from harness.waits import wait_for
from tests.fakes.http_engine import POISON, PoisonEngine
from tests.support.commands import invoke

pytestmark = [pytest.mark.fault, pytest.mark.integration, pytest.mark.slow]
# SGLang's tokenizer manager (`_validate_one_request`), on /generate as on the chat endpoint.
LONGER_THAN_CONTEXT = re.compile(
    r"The input \((?P<tokens>\d+) tokens\) is longer than the model's context length "
    r"\(4096 tokens\)\."
)


def cli(*args: str) -> Any:
    result = invoke(*args)
    assert result.exit_code == 0, result.output
    return result


def external_engine_worker(
    start_worker: Callable[..., Worker],
    redis_url: str,
    store_url: str,
    engine: PoisonEngine,
    log_dir: Path,
) -> tuple[Worker, Settings]:
    """A worker on `engine` (two request and two batch retries), started, and the producer's
    settings naming the model it serves: this external engine."""
    env = base_env(
        redis_url,
        store_url,
        engine="external",
        engine_url=engine.url,
        request_retries=2,
        batch_retries=2,
        log_dir=log_dir,
    )
    settings = fault_settings(redis_url, store_url, engine="external", engine_url=engine.url)
    return start_worker(env), settings


def test_a_broken_engine_parks_batches_in_the_failed_set_and_retry_completes_them(
    tmp_path: Path,
    redis_url: str,
    redis_client: redis.Redis,
    start_worker: Callable[..., Worker],
    fake_engine: PoisonEngine,
) -> None:
    store_url = (tmp_path / "store").as_uri()
    # The engine answers 500 to everything: not the prompts' fault, so no error records; the
    # batches' tries fail and they land in the failed set.
    fake_engine.broken = True
    ids = write_prompts(tmp_path / "prompts.jsonl", 50)
    worker, settings = external_engine_worker(
        start_worker, redis_url, store_url, fake_engine, tmp_path
    )
    worker.wait_ready()
    started = time.monotonic()
    stage(settings, "poison", tmp_path / "prompts.jsonl")
    store = open_run_store(settings)
    flags = ["--redis-url", redis_url, "--store", store_url]

    def failed_report() -> dict[str, Any] | None:
        # stdout only: what another thread of this process writes meanwhile goes to stderr
        report: dict[str, Any] = json.loads(cli("status", "poison", "--json", *flags).stdout)
        return report if report["batches_failed"] == 2 else None

    report = wait_for(failed_report, 120, "both batches to land in the failed set", 0.5)
    to_failed_s = time.monotonic() - started
    assert report["state"] == "failed"
    assert sorted(report["failed"]) == ["batch-000000", "batch-000001"]
    assert all("EngineDown" in error for error in report["failed"].values())
    for batch in report["failed"]:
        tries = int(redis_client.hget(keys.attempts_key("poison"), batch) or 0)
        assert tries == 3  # batch_retries=2: the first try and two retries
    assert fake_engine.failed_requests >= 2 * 3 * 3  # each try: one request and two retries
    assert worker.proc.poll() is None

    fake_engine.broken = False  # the fix
    retried = cli("retry", "poison", *flags)
    assert "2 failed batches cleared; enqueued 2" in " ".join(retried.output.split())
    wait_run_done(settings, redis_client, "poison", 60, store)
    result, _rows = assert_exactly_once(settings, "poison", ids, redis_client, store)
    assert result.errors == 0
    assert not redis_client.hgetall(keys.failed_key("poison"))
    print(
        f"\n[fault broken engine] failed set after {to_failed_s:.1f} s and 3 tries a batch "
        f"({fake_engine.failed_requests} requests answered 500); retry completed it; "
        f"{result.records} records exported"
    )


def test_poison_prompts_among_served_ones_become_error_records_and_the_batch_goes_on(
    tmp_path: Path,
    redis_url: str,
    redis_client: redis.Redis,
    start_worker: Callable[..., Worker],
    fake_engine: PoisonEngine,
) -> None:
    store_url = (tmp_path / "store").as_uri()
    poison = {i: f"{POISON} {i}" for i in range(0, 100, 10)}  # one in ten, in every batch
    ids = write_prompts(tmp_path / "prompts.jsonl", 100, poison)
    worker, settings = external_engine_worker(
        start_worker, redis_url, store_url, fake_engine, tmp_path
    )
    worker.wait_ready()
    stage(settings, "poisoned", tmp_path / "prompts.jsonl")
    store = open_run_store(settings)
    wait_run_done(settings, redis_client, "poisoned", 120, store)

    result, rows = assert_exactly_once(settings, "poisoned", ids, redis_client, store)
    errors = {row["id"] for row in rows if row["error"]}
    assert errors == {ids[i] for i in poison}
    assert not redis_client.hgetall(keys.failed_key("poisoned"))
    assert not redis_client.hgetall(keys.attempts_key("poisoned"))  # no batch try spent
    assert fake_engine.failed_requests == len(poison) * 3  # each prompt: a try and two more


def test_prompts_longer_than_the_context_become_error_records(
    tmp_path: Path,
    redis_url: str,
    redis_client: redis.Redis,
    start_worker: Callable[..., Worker],
) -> None:
    store_url = (tmp_path / "store").as_uri()
    too_long = "many words " * 2000  # about 5,500 tokens for the emulator's counter
    marked = {i: too_long for i in range(3, 150, 10)}
    ids = write_prompts(tmp_path / "prompts.jsonl", 150, marked)
    worker = start_worker(base_env(redis_url, store_url, context_length=4096, log_dir=tmp_path))
    settings = fault_settings(redis_url, store_url)
    stage(settings, "toolong", tmp_path / "prompts.jsonl")
    worker.wait_ready()
    wait_run_done(settings, redis_client, "toolong", 90)

    result, rows = assert_exactly_once(settings, "toolong", ids, redis_client)
    errors = {row["id"]: row["error"] for row in rows if row["error"]}
    assert set(errors) == {ids[i] for i in marked}
    for error in errors.values():  # the engine's own words: too long for its context
        said = LONGER_THAN_CONTEXT.search(error["message"])
        assert said is not None and int(said["tokens"]) >= 4096, error
    for row in rows:  # an error record: no answer, no finish
        if row["error"]:
            assert (row["content"], row["finish_reason"]) == (None, None), row
    assert result.errors == len(marked)
    assert int(redis_client.hget(keys.counters_key("toolong"), "errors") or 0) == len(marked)
    print(
        f"\n[fault too-long] {len(marked)} prompts refused as error records, "
        f"{result.records - result.errors} completions"
    )


class _RunsCodeWhenUnpickled:
    """Unpickling this opens (creates) `path`: proof of execution if the file appears."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def __reduce__(self) -> tuple[Any, ...]:
        return (open, (str(self.path), "w"))


def test_pickled_message_is_refused_and_the_worker_keeps_working(
    tmp_path: Path,
    redis_url: str,
    redis_client: redis.Redis,
    start_worker: Callable[..., Worker],
) -> None:
    store_url = (tmp_path / "store").as_uri()
    worker = start_worker(base_env(redis_url, store_url, log_dir=tmp_path))
    worker.wait_ready()
    proof = tmp_path / "executed-by-unpickling"
    attacker = Celery("attacker", broker=redis_url)
    attacker.conf.update(task_serializer="pickle", accept_content=["pickle", "json"])
    attacker.send_task(
        GENERATE_TASK,
        kwargs={"order": _RunsCodeWhenUnpickled(proof)},
        queue="gpu.emulator",
        serializer="pickle",
    )
    attacker.close()
    # the worker took the message (off the queue, not held unacknowledged) and ran nothing
    wait_for(
        lambda: redis_client.llen("gpu.emulator") == 0 and not redis_client.hlen("unacked"),
        30,
        "the worker to take and drop the pickled message",
        0.2,
    )
    assert not proof.exists(), "the pickled payload was executed"
    assert worker.proc.poll() is None

    ids = write_prompts(tmp_path / "prompts.jsonl", 60)
    settings = fault_settings(redis_url, store_url)
    stage(settings, "afterpickle", tmp_path / "prompts.jsonl")
    wait_run_done(settings, redis_client, "afterpickle", 60)
    result, _rows = assert_exactly_once(settings, "afterpickle", ids, redis_client)
    assert worker.proc.poll() is None
    # the worker's prefetch held the pickled message, if at all, before this run's orders
    assert not proof.exists(), "the pickled payload was executed"
    # Rejected, not left to be delivered again: the unacked hash drains (the run's last order
    # is acked just after its output is written, which is what "done" waited for).
    wait_for(lambda: not redis_client.hlen("unacked"), 10, "nothing left unacknowledged", 0.2)
    print(f"\n[fault pickle] refused; the next run exported {result.records} records")
