"""`genfleet run` when Redis dies under it: it exits with an error and stops every process
it started (workers, engines, beat), rather than crash and leave its fleet running."""

from __future__ import annotations

from pathlib import Path

import pytest

from harness.services import RedisServer
from harness.sources import write_prompts
from tests.support.commands import StartRun

pytestmark = [pytest.mark.fault, pytest.mark.integration, pytest.mark.slow]


def test_run_stops_its_fleet_when_redis_fails(
    tmp_path: Path, private_redis: RedisServer, start_run: StartRun
) -> None:
    write_prompts(tmp_path / "slow.jsonl", 200)
    run = start_run(private_redis.url, tmp_path / "slow.jsonl")
    run.wait_running(private_redis.client())
    assert len(run.processes()) >= 3  # run, workers, engine
    private_redis.kill()
    run.proc.wait(timeout=150)
    assert run.proc.returncode == 2, run.log()
    run.wait_gone()
