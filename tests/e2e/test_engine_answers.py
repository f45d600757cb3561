"""A real worker against an engine that answers badly: 429s, aborts, OpenAI's usage shape and
an enforced cap below the configured one. Nothing aborted is stored, no 429 fails anything,
reasoning is counted, and the client fills the cap the engine enforces, not the configured one.

Real Redis, a real Celery worker process, the emulator started by the real supervisor; the
emulator's request log says what each request got.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import redis

from genfleet.common import keys
from genfleet.common.settings import Settings
from harness.env import base_env
from harness.processes import Worker
from harness.resends import sent_lines
from harness.runs import export_rows, stage, wait_run_ended
from harness.sources import lines

pytestmark = [pytest.mark.integration, pytest.mark.slow]

PROMPTS = 200
CONFIGURED_CAP = 64
ENFORCED_CAP = 12


def test_bad_answers_end_as_completions_or_error_records_never_as_wrong_data(
    tmp_path: Path,
    redis_url: str,
    redis_client: redis.Redis,
    start_worker: Callable[..., Worker],
) -> None:
    ids = [f"q{i:04d}" for i in range(PROMPTS)]
    rows = [{"id": i, "prompt": f"Question {n}: why is {n} odd?"} for n, i in enumerate(ids)]
    source = lines(tmp_path / "prompts.jsonl", rows)
    store_url = (tmp_path / "store").as_uri()
    request_log = tmp_path / "requests.jsonl"
    env = base_env(
        redis_url,
        store_url,
        emulator_429_rate=0.05,
        emulator_retry_after_s=0.05,
        emulator_abort_rate=0.10,
        emulator_usage_shape="openai",
        emulator_request_log=request_log,
        emulator_effective_max_running_requests=ENFORCED_CAP,
        max_running_requests=CONFIGURED_CAP,
        batch_size=50,
    )
    worker = start_worker(env)
    settings = Settings(redis_url=redis_url, store=store_url, batch_size=50, max_tokens=1024)
    stage(settings, "answers", source)
    worker.wait_ready()
    status = wait_run_ended(settings, redis_client, "answers", 180)
    assert status["state"] == "done", status
    assert status["batches_failed"] == 0

    _, rows = export_rows(settings, "answers", tmp_path / "out.jsonl")
    assert [row["id"] for row in rows] == ids  # every prompt ends, once
    log = sent_lines(request_log)
    outcomes = [entry["outcome"] for entry in log]
    assert outcomes.count("429") > 0 and outcomes.count("abort") > 0
    aborted = {entry["id"] for entry in log if entry["outcome"] == "abort"}

    completions = [row for row in rows if row["error"] is None]
    errors = [row for row in rows if row["error"] is not None]
    # an error record only for a prompt aborted on every try, never for a 429
    assert all(row["error"]["type"] == "abort" for row in errors)
    assert len(completions) >= PROMPTS - 2
    for row in completions:
        assert row["request_id"] not in aborted
        assert row["finish_reason"] in {"stop", "length"}
        assert row["content"] is not None
        # thinking on: OpenAI's nested usage shape is read, not taken for 0
        assert row["usage"]["completion_tokens"] >= row["usage"]["reasoning_tokens"] > 0
    for row in errors:
        assert (row["content"], row["finish_reason"]) == (None, None)
    counted = int(redis_client.hget(keys.counters_key("answers"), "reasoning_tokens") or 0)
    assert counted == sum(row["usage"]["reasoning_tokens"] for row in completions)

    # the client fills the cap the engine enforces (a little above it), not the configured 64
    most = max(entry["in_engine"] for entry in log)
    assert ENFORCED_CAP <= most <= int(ENFORCED_CAP * 1.25) + 4
