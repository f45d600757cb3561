"""The quality gate as a user meets it: `genfleet run` with real workers, Redis and the
emulator. A run whose answers are mostly empty and cut pauses itself within the configured
answers, holds its orders and says what to change; `run` again resumes it and every prompt
gets its output exactly once; a healthy run never trips it."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import redis

from genfleet.common import quality_gate
from genfleet.common.settings import Settings
from genfleet.common.store import open_store
from genfleet.producer.status import run_status
from harness.assertions import assert_exactly_once
from harness.env import base_env
from harness.runs import outputs
from harness.sources import write_prompts
from tests.support.commands import genfleet

pytestmark = [pytest.mark.integration, pytest.mark.slow]

MIN_ANSWERS = 50
BATCH = 10


def test_a_run_of_cut_answers_pauses_holds_its_orders_and_resumes_exactly_once(
    tmp_path: Path, redis_url: str, redis_client: redis.Redis
) -> None:
    store_url = (tmp_path / "store").as_uri()
    # Thinking on and 16 tokens: the emulator's reasoning (70 % of a ~200-token answer) uses
    # the whole budget, so nearly every answer is empty and cut.
    env = base_env(
        redis_url,
        store_url,
        log_dir=tmp_path / "logs",
        max_tokens=16,
        reasoning_parser="qwen3",
        emulator_time_scale=20,
        progress_interval_s=1,
    )
    source = tmp_path / "cut.jsonl"
    ids = write_prompts(source, 600, prefix="c")
    args = ["run", str(source), "--batch-size", str(BATCH)]
    args += ["--quality-gate-min-answers", str(MIN_ANSWERS)]
    paused = genfleet(args, env)
    said = " ".join((paused.stdout + paused.stderr).split())
    assert paused.returncode == 1, said
    assert "paused by the quality gate: reasoning used all 16 tokens" in said
    assert "raise --max-tokens to " in said and "or --no-thinking" in said

    store = open_store(store_url)
    verdict = quality_gate.paused(redis_client, "cut")
    assert verdict is not None
    # Judged once the first answers were in: the window held at least the minimum, and the
    # verdict came from the batches that landed first, not from the whole run.
    assert MIN_ANSWERS <= verdict["answers"] <= MIN_ANSWERS + 4 * BATCH
    assert verdict["shares"]["reasoning_full"] > 0.9
    assert verdict["suggested_max_tokens"] >= 32
    assert verdict["suggested_max_tokens"] & (verdict["suggested_max_tokens"] - 1) == 0
    report = run_status(store, redis_client, "cut")
    assert report["state"] == "paused"
    held = len(outputs(store, "cut"))
    assert held * BATCH < len(ids) / 2, "the orders were held, not run to the end"
    assert report["quality"]["so_far"]["shares"]["empty"] > 0.9
    time.sleep(2)
    assert len(outputs(store, "cut")) == held  # nothing runs while paused

    # Resumed as is, without the gate: the rest runs, every prompt exactly once.
    resumed = genfleet([*args, "--no-quality-gate"], env)
    said = " ".join((resumed.stdout + resumed.stderr).split())
    assert resumed.returncode == 0, said
    assert "cut: done — 600/600 prompts (0 error records; answers: 0.0% kept" in said
    assert "cut at max_tokens" in said
    assert quality_gate.paused(redis_client, "cut") is None
    settings = Settings(redis_url=redis_url, store=store_url)
    assert_exactly_once(settings, "cut", ids, redis_client, store)


def test_a_healthy_run_of_2000_prompts_never_trips_the_gate(
    tmp_path: Path, redis_url: str, redis_client: redis.Redis
) -> None:
    store_url = (tmp_path / "store").as_uri()
    env = base_env(
        redis_url,
        store_url,
        log_dir=tmp_path / "logs",
        emulator_time_scale=2000,
        emulator_mean_completion_tokens=120,
        reasoning_parser="qwen3",
        progress_interval_s=1,
    )
    source = tmp_path / "healthy.jsonl"
    ids = write_prompts(source, 2000, prefix="h")
    args = ["run", str(source), "--batch-size", "25", "--quality-gate-min-answers", "20"]
    args += ["--quality-window-answers", "50"]
    result = genfleet(args, env)
    said = " ".join((result.stdout + result.stderr).split())
    assert result.returncode == 0, said
    assert quality_gate.paused(redis_client, "healthy") is None
    report = run_status(open_store(store_url), redis_client, "healthy")
    assert report["state"] == "done"
    so_far = report["quality"]["so_far"]
    assert so_far["answers"] == 2000
    assert so_far["shares"]["kept"] > 0.8, so_far
    assert f"answers: {so_far['shares']['kept']:.1%} kept" in said
    settings = Settings(redis_url=redis_url, store=store_url)
    assert_exactly_once(settings, "healthy", ids, redis_client, store=open_store(store_url))
