"""A run is its prompts, parameters and model: anything different is refused (exit 2), with
the store and the queue untouched; the same again resumes and doubles nothing."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import orjson
import pytest
import redis
from typer.testing import CliRunner

from genfleet.cli import app
from genfleet.common import keys
from harness.env import base_env
from harness.sources import write_prompt_lines
from tests.support.commands import genfleet, invoke

pytestmark = pytest.mark.integration


def store_snapshot(root: Path) -> dict[str, bytes]:
    return {p.relative_to(root).as_posix(): p.read_bytes() for p in root.rglob("*") if p.is_file()}


def redis_snapshot(client: redis.Redis) -> dict[bytes, Any]:
    return {key: client.dump(key) for key in client.keys("*")}


def test_enqueue_other_data_or_settings_into_a_run_is_refused_and_touches_nothing(
    tmp_path: Path, redis_url: str, redis_client: redis.Redis
) -> None:
    root = tmp_path / "store"
    env = {"GENFLEET_REDIS_URL": redis_url, "GENFLEET_STORE": root.as_uri()}
    first = write_prompt_lines(tmp_path / "a" / "prompts.jsonl", [f"q{i}" for i in range(30)])
    other = write_prompt_lines(tmp_path / "b" / "prompts.jsonl", [f"other {i}" for i in range(30)])
    staged = invoke("enqueue", str(first), "--run", "x", "--batch-size", "10", "--json", env=env)
    assert staged.exit_code == 0, staged.output
    assert redis_client.llen("gpu.emulator") == 3
    store_before, redis_before = store_snapshot(root), redis_snapshot(redis_client)

    refusals = {
        "other data": ([str(other)], ["prompts: the run holds", str(first), str(other)]),
        "other params": (
            [str(first), "--max-tokens", "5"],
            ["max_tokens: the run has 8192, now 5"],
        ),
        "other batching": (
            [str(first), "--batch-size", "7"],
            ["batch_size: the run has 10, now 7"],
        ),
        "other samples": (
            [str(first), "--samples", "2"],
            ["prompts: the run holds", "samples: the run has 1, now 2"],
        ),
        "other model": (
            [str(first), "--model", "/models/q", "--served-model-name", "q"],
            ["engine: the run has 'emulator', now 'sglang'", "model: the run has 'emulator'"],
        ),
    }
    for what, (args, expected) in refusals.items():
        batch = [] if "--batch-size" in args else ["--batch-size", "10"]
        result = invoke("enqueue", *args, "--run", "x", *batch, env=env)
        message = " ".join(result.output.split())
        assert result.exit_code == 2, (what, result.output)
        for text in expected:
            assert text in message, (what, text, message)
        assert "--run NEW" in message and "genfleet delete x" in message, message
        assert store_snapshot(root) == store_before, what
        assert redis_snapshot(redis_client) == redis_before, what

    # The same again resumes: nothing is sent twice, nothing is staged again.
    again = invoke("enqueue", str(first), "--run", "x", "--batch-size", "10", "--json", env=env)
    assert again.exit_code == 0, again.output
    report = orjson.loads(again.stdout)
    assert (report["staged"], report["batches_enqueued"]) == (False, 0)
    assert redis_client.llen("gpu.emulator") == 3
    assert store_snapshot(root) == store_before


def stage_x(tmp_path: Path, redis_url: str, prompts: int) -> tuple[Path, dict[str, str], Path]:
    """Run x: `prompts` prompts staged in batches of 10 into a file store; (store root, the
    CLI's environment, the source)."""
    root = tmp_path / "store"
    env = {"GENFLEET_REDIS_URL": redis_url, "GENFLEET_STORE": root.as_uri()}
    source = write_prompt_lines(tmp_path / "p.jsonl", [f"q{i}" for i in range(prompts)])
    staged = invoke("enqueue", str(source), "--run", "x", "--batch-size", "10", env=env)
    assert staged.exit_code == 0, staged.output
    return root, env, source


def test_resume_or_retry_asking_for_another_model_or_setting_is_refused_and_touches_nothing(
    tmp_path: Path, redis_url: str, redis_client: redis.Redis
) -> None:
    root, env, _source = stage_x(tmp_path, redis_url, 30)
    redis_client.delete("gpu.emulator")  # as if Redis lost the orders: a resume would resend
    # a failed batch: a refused retry must leave it in the failed set, not clear it
    redis_client.hset(keys.failed_key("x"), keys.batch_id(1), "EngineDown: gone")
    store_before, redis_before = store_snapshot(root), redis_snapshot(redis_client)

    refusals: dict[str, tuple[list[str], dict[str, str], list[str]]] = {
        "resume, other model": (
            ["enqueue", "--resume", "x", "--model", "/models/q"],
            {},
            ["engine: the run has 'emulator', now 'sglang'", "model: the run has 'emulator'"],
        ),
        "resume, other params": (
            ["enqueue", "--resume", "x", "--max-tokens", "5", "--temperature", "0.1"],
            {},
            ["max_tokens: the run has 8192, now 5", "temperature: the run has"],
        ),
        "resume, other batching": (
            ["enqueue", "--resume", "x", "--batch-size", "7"],
            {},
            ["batch_size: the run has 10, now 7"],
        ),
        "retry, model from the environment": (
            ["retry", "x"],
            {"GENFLEET_ENGINE": "external", "GENFLEET_ENGINE_URL": "http://h:1"},
            ["engine: the run has 'emulator', now 'external'"],
        ),
    }
    for what, (args, extra_env, expected) in refusals.items():
        result = CliRunner().invoke(app, args, env={**env, **extra_env})
        message = " ".join(result.output.split())
        assert result.exit_code == 2, (what, result.output)
        for text in expected:
            assert text in message, (what, text, message)
        assert "--run NEW" in message, message
        assert store_snapshot(root) == store_before, what
        assert redis_snapshot(redis_client) == redis_before, what

    # The run's own settings, given or not, resume it: the three lost orders go out once.
    for args in (["--resume", "x", "--batch-size", "10", "--json"], ["--resume", "x", "--json"]):
        resumed = invoke("enqueue", *args, env=env)
        assert resumed.exit_code == 0, resumed.output
    assert redis_client.llen("gpu.emulator") == 3


def test_an_interrupted_staging_is_not_finished_with_another_model(
    tmp_path: Path, redis_url: str, redis_client: redis.Redis
) -> None:
    root, env, source = stage_x(tmp_path, redis_url, 20)
    (root / keys.manifest_key("x")).unlink()  # as if staging stopped before its manifest
    result = invoke(
        "enqueue", str(source), "--run", "x", "--batch-size", "10", "--model", "/m/q", env=env
    )
    assert result.exit_code == 2, result.output
    assert "engine: the run has 'emulator', now 'sglang'" in " ".join(result.output.split())
    assert not (root / keys.manifest_key("x")).exists()
    assert set(redis_client.keys("gpu.*")) == {b"gpu.emulator"}  # no order for the model


def test_an_interrupted_staging_is_not_finished_with_other_data(
    tmp_path: Path, redis_url: str, redis_client: redis.Redis
) -> None:
    root, env, source = stage_x(tmp_path, redis_url, 30)
    (root / keys.manifest_key("x")).unlink()  # as if staging stopped before its manifest
    inputs_before = {k: v for k, v in store_snapshot(root).items() if "/inputs/" in k}
    orders_before = redis_client.llen("gpu.emulator")
    write_prompt_lines(source, [f"q{i}" + (" edited" if i == 25 else "") for i in range(30)])

    result = invoke("enqueue", str(source), "--run", "x", "--batch-size", "10", env=env)

    message = " ".join(result.output.split())
    assert result.exit_code == 2, message
    assert "prompts: the run holds" in message and "interrupted staging" in message
    assert "first difference: batch-000002, prompt" in message  # q25 of batches of 10
    assert not (root / keys.manifest_key("x")).exists()
    assert {k: v for k, v in store_snapshot(root).items() if "/inputs/" in k} == inputs_before
    assert redis_client.llen("gpu.emulator") == orders_before
    # The data it was staged with finishes it.
    write_prompt_lines(source, [f"q{i}" for i in range(30)])
    finished = invoke("enqueue", str(source), "--run", "x", "--batch-size", "10", env=env)
    assert finished.exit_code == 0, finished.output
    assert (root / keys.manifest_key("x")).exists()
    assert redis_client.llen("gpu.emulator") == orders_before  # nothing sent twice


@pytest.mark.slow
def test_run_of_another_file_with_the_same_name_is_refused(
    tmp_path: Path, redis_url: str, redis_client: redis.Redis
) -> None:
    root = tmp_path / "store"
    env = base_env(redis_url, root.as_uri(), log_dir=tmp_path / "logs")
    demo = genfleet(["run", "examples/prompts.jsonl", "--batch-size", "20"], env)
    assert demo.returncode == 0, demo.stdout + demo.stderr
    store_before, redis_before = store_snapshot(root), redis_snapshot(redis_client)
    other = write_prompt_lines(
        tmp_path / "other" / "prompts.jsonl", [f"mine {i}" for i in range(10)]
    )

    for args, expected in (
        ([str(other), "--max-tokens", "5"], ["prompts: the run holds", "max_tokens"]),
        (
            ["examples/prompts.jsonl", "--engine", "external", "--engine-url", "http://h:1"],
            ["engine: the run has 'emulator', now 'external'"],
        ),
    ):
        refused = genfleet(["run", *args, "--batch-size", "20"], env)
        message = " ".join((refused.stdout + refused.stderr).split())
        assert refused.returncode == 2, message
        for text in expected:
            assert text in message, message
        assert "already done" not in message
        assert "--run NEW" in message and "genfleet delete prompts" in message
        assert store_snapshot(root) == store_before
        assert redis_snapshot(redis_client) == redis_before

    # the file gets its own run with --run, and both runs keep their own data
    own = genfleet(["run", str(other), "--run", "mine", "--batch-size", "20"], env)
    assert own.returncode == 0, own.stdout + own.stderr
    out = tmp_path / "mine.jsonl"
    assert genfleet(["export", "mine", "--out", str(out)], env).returncode == 0
    rows = [orjson.loads(line) for line in out.read_bytes().splitlines()]
    assert [r["messages"][-1]["content"] for r in rows] == [f"mine {i}" for i in range(10)]
