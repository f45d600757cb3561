"""The quality gate as a user meets it: `genfleet run` with real workers, Redis and the
emulator. A run whose answers are mostly empty and cut pauses itself within the configured
answers, holds its orders and says what to change; `run` again resumes it and every prompt
gets its output exactly once; a healthy run never trips it."""

from __future__ import annotations

import time
from pathlib import Path

import orjson
import pytest
import redis

from genfleet.common import quality_gate
from genfleet.common.manifest import Manifest
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


def _paused_run(
    tmp_path: Path, redis_url: str, redis_client: redis.Redis, prompts: int
) -> tuple[dict[str, str], list[str], list[str]]:
    """A `genfleet run` whose answers are all empty and cut, paused by the gate: its env,
    prompt ids and arguments, once the pause and the held orders are checked."""
    store_url = (tmp_path / "store").as_uri()
    # Thinking on and 16 tokens: the emulator's reasoning (70 % of a ~200-token answer) uses
    # the whole budget, so nearly every answer is empty and cut (the rare one under 16
    # tokens finishes).
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
    ids = write_prompts(source, prompts, prefix="c")
    args = ["run", str(source), "--batch-size", str(BATCH)]
    args += ["--quality-gate-min-answers", str(MIN_ANSWERS)]
    paused = genfleet(args, env)
    said = " ".join((paused.stdout + paused.stderr).split())
    assert paused.returncode == 1, said
    assert "paused by the quality gate: reasoning used all 16 tokens" in said
    assert "raise --max-tokens to 32, or --no-thinking" in said
    assert "--change-params --max-tokens 32 for the rest" in said

    store = open_store(store_url)
    verdict = quality_gate.paused(redis_client, "cut")
    assert verdict is not None
    # Judged once the first answers were in: the window held at least the minimum, and the
    # verdict came from the batches that landed first, not from the whole run.
    assert MIN_ANSWERS <= verdict["answers"] <= MIN_ANSWERS + 4 * BATCH
    assert verdict["shares"]["reasoning_full"] > 0.9
    assert verdict["suggested_max_tokens"] == 32
    report = run_status(store, redis_client, "cut")
    assert report["state"] == "paused"
    held = len(outputs(store, "cut"))
    assert held * BATCH < len(ids) / 2, "the orders were held, not run to the end"
    assert report["quality"]["so_far"]["shares"]["empty"] > 0.9
    time.sleep(2)
    assert len(outputs(store, "cut")) == held  # nothing runs while paused
    return env, ids, args


def test_a_run_of_cut_answers_pauses_holds_its_orders_and_resumes_with_a_new_cap(
    tmp_path: Path, redis_url: str, redis_client: redis.Redis
) -> None:
    env, ids, args = _paused_run(tmp_path, redis_url, redis_client, 600)
    store = open_store(env["GENFLEET_STORE"])
    done_before = len(outputs(store, "cut")) * BATCH

    # Resumed with a cap that fits, the gate still on: the rest runs, every prompt once.
    resumed = genfleet([*args, "--change-params", "--max-tokens", "1024"], env)
    said = " ".join((resumed.stdout + resumed.stderr).split())
    assert resumed.returncode == 0, said
    assert "the batches not yet done go on with max_tokens=1024" in said
    assert "cut: done — 600/600 prompts (0 error records; answers: " in said
    assert quality_gate.paused(redis_client, "cut") is None
    settings = Settings(redis_url=redis_url, store=env["GENFLEET_STORE"])
    _, rows = assert_exactly_once(settings, "cut", ids, redis_client, store)
    kept = sum(1 for row in rows if row["finish_reason"] == "stop" and row["content"])
    assert kept >= 0.8 * (len(ids) - done_before)
    # The change is the run's now: its manifest says so, and the old cap is another run.
    manifest = Manifest.load(store, "cut")
    assert manifest is not None and manifest.params.max_tokens == 1024
    assert [c["params"] for c in manifest.changes] == [{"max_tokens": 1024}]
    again = genfleet(args, env, timeout_s=60)
    assert again.returncode == 2
    assert "max_tokens: the run has 1024, now 16" in " ".join(again.stderr.split())


def test_a_paused_run_goes_on_as_it_is_without_the_gate(
    tmp_path: Path, redis_url: str, redis_client: redis.Redis
) -> None:
    # 600 prompts: a worker holds as many batches as its engine has room for (25 of 10 at
    # the emulator's cap of 256), all of which finish after the pause.
    env, ids, args = _paused_run(tmp_path, redis_url, redis_client, 600)
    resumed = genfleet([*args, "--no-quality-gate"], env)
    said = " ".join((resumed.stdout + resumed.stderr).split())
    assert resumed.returncode == 0, said
    assert "cut: done — 600/600 prompts (0 error records; answers: 0.0% kept, 9" in said
    assert "% cut at max_tokens" in said
    settings = Settings(redis_url=redis_url, store=env["GENFLEET_STORE"])
    store = open_store(env["GENFLEET_STORE"])
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


def test_a_regeneration_much_shorter_than_the_old_answers_pauses(
    tmp_path: Path, redis_url: str, redis_client: redis.Redis
) -> None:
    store_url = (tmp_path / "store").as_uri()
    env = base_env(
        redis_url,
        store_url,
        log_dir=tmp_path / "logs",
        reasoning_parser="qwen3",
        emulator_mean_completion_tokens=60,
    )
    # Old answers of 4,000 characters; the emulator's new ones are a few hundred.
    source = tmp_path / "regen.jsonl"
    old = "A thorough old answer. " * 174
    source.write_bytes(
        b"".join(
            orjson.dumps(
                {
                    "id": f"r{i}",
                    "conversations": [
                        {"from": "human", "value": f"question {i}"},
                        {"from": "gpt", "value": old},
                    ],
                }
            )
            + b"\n"
            for i in range(300)
        )
    )
    args = ["run", str(source), "--regenerate", "--batch-size", str(BATCH)]
    result = genfleet([*args, "--quality-gate-min-answers", str(MIN_ANSWERS)], env)
    said = " ".join((result.stdout + result.stderr).split())
    assert result.returncode == 1, said
    assert "of the old answer's length" in said
    verdict = quality_gate.paused(redis_client, "regen")
    assert verdict is not None and verdict["shares"]["shorter"] > 0.9
    # the old answers' p95 (4,000 characters, 1,000 tokens) rounded up fits the cap: no
    # cap to raise, the model or its settings answer shorter
    assert verdict["suggested_max_tokens"] is None
    assert "the old answers' p95 is 1,024 tokens, within --max-tokens 1,024" in said
    report = run_status(open_store(store_url), redis_client, "regen")
    assert report["state"] == "paused"
    assert report["quality"]["so_far"]["regenerated"] < 300
