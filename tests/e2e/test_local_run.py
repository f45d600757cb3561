"""`genfleet run`, the main job on one machine, as a user runs it: one command, exit 0."""

from __future__ import annotations

import signal
from pathlib import Path

import orjson
import pytest
import redis

from harness.env import ROOT, base_env, free_port
from harness.processes import processes_with_env
from harness.sources import write_prompts
from tests.support.commands import StartRun, genfleet

pytestmark = [pytest.mark.integration, pytest.mark.slow]


def test_run_on_embedded_defaults_then_export(tmp_path: Path, redis_url: str) -> None:
    store = (tmp_path / "store").as_uri()
    env = base_env(
        redis_url,
        store,
        log_dir=tmp_path / "logs",
        power_watch_interval_s=2,
        progress_interval_s=1,
    )
    result = genfleet(["run", "examples/prompts.jsonl", "--batch-size", "20"], env)
    output = result.stdout + result.stderr
    assert result.returncode == 0, output
    assert "ENGINE: the genfleet emulator" in output
    assert "prompts: done — 100/100 prompts" in " ".join(output.split())
    # Piped (no terminal): a status line a second while it ran, each whole on one line.
    progress = [
        line
        for line in result.stderr.splitlines()
        if line.startswith(("prompts: queued", "prompts: running")) and "ETA" in line
    ]
    assert len(progress) >= 2, result.stderr
    out = tmp_path / "prompts.jsonl"
    exported = genfleet(["export", "prompts", "--out", str(out)], env)
    assert exported.returncode == 0, exported.stderr
    rows = [orjson.loads(line) for line in out.read_bytes().splitlines()]
    source = [
        orjson.loads(line) for line in (ROOT / "examples/prompts.jsonl").read_bytes().splitlines()
    ]
    assert [r["id"] for r in rows] == [s["id"] for s in source]
    # a second run of a finished run does nothing and still says done
    again = genfleet(["run", "examples/prompts.jsonl", "--batch-size", "20"], env)
    assert again.returncode == 0, again.stderr
    assert "run prompts is already done" in " ".join((again.stdout + again.stderr).split())
    # nothing left running: the workers and engines of both runs are gone
    leftover = processes_with_env(f"GENFLEET_STORE={store}")
    assert leftover == [], [Path(f"/proc/{pid}/cmdline").read_bytes() for pid in leftover]


def test_run_without_redis_says_how_to_start_one(tmp_path: Path) -> None:
    env = base_env(f"redis://127.0.0.1:{free_port()}/0", (tmp_path / "s").as_uri())
    result = genfleet(["run", "examples/prompts.jsonl"], env, timeout_s=60)
    assert result.returncode == 2
    message = " ".join(result.stderr.split())
    assert "no Redis answers at redis://127.0.0.1" in message
    assert "redis-server" in message


def test_run_checks_the_checkpoint_before_starting_anything(tmp_path: Path, redis_url: str) -> None:
    model = tmp_path / "qwen"
    model.mkdir()
    (model / "config.json").write_text(
        '{"architectures": ["Qwen3NextForCausalLM"], "num_hidden_layers": 4}'
    )
    (model / "model.safetensors.index.json").write_text(
        '{"weight_map": {"model.layers.0.mlp.weight": "a.safetensors"}}'
    )
    store = (tmp_path / "store").as_uri()
    env = base_env(redis_url, store)
    result = genfleet(["run", "examples/prompts.jsonl", "--model", str(model)], env, 60)
    message = " ".join(result.stderr.split())
    assert result.returncode == 2, result.stdout + result.stderr
    assert str(model) in message and "--no-mtp" in message
    assert not (tmp_path / "store").exists()  # nothing was staged or started


def test_a_second_run_is_refused_while_the_first_fleet_lives(
    tmp_path: Path, redis_url: str, start_run: StartRun
) -> None:
    """One local fleet per user and host: a second `genfleet run` exits 2 and starts nothing;
    SIGTERM to the first stops its whole fleet, after which a run may start again."""
    write_prompts(tmp_path / "first.jsonl", 200)
    write_prompts(tmp_path / "second.jsonl", 10, prefix="s")
    first = start_run(redis_url, tmp_path / "first.jsonl")
    client = redis.Redis.from_url(redis_url)
    first.wait_running(client)
    client.close()
    env = first.env
    other_logs = tmp_path / "second-logs"
    second = genfleet(
        ["run", str(tmp_path / "second.jsonl"), "--log-dir", str(other_logs)], env, 60
    )
    assert second.returncode == 2, second.stdout + second.stderr
    assert not processes_with_env(f"GENFLEET_LOG_DIR={other_logs}")  # it started nothing
    first.proc.send_signal(signal.SIGTERM)
    first.proc.wait(timeout=120)
    assert first.proc.returncode == 130, first.log()
    first.wait_gone()
    # the emulator at the tests' usual speed: what is checked now is that a run may start
    fast = {**env, "GENFLEET_EMULATOR_TIME_SCALE": "200"}
    again = genfleet(["run", str(tmp_path / "second.jsonl")], fast, timeout_s=120)
    assert again.returncode == 0, again.stdout + again.stderr
