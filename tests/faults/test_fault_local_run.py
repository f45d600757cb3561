"""`genfleet run` when Redis dies under it: it exits with an error and stops every process
it started (workers, engines, beat), rather than crash and leave its fleet running."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from genfleet.common import keys
from tests.e2e.test_local_run import processes_with_env
from tests.faults.services import RedisServer
from tests.support import ROOT, base_env, wait_for, write_prompts

pytestmark = [pytest.mark.fault, pytest.mark.integration, pytest.mark.slow]


def test_run_stops_its_fleet_when_redis_fails(tmp_path: Path, private_redis: RedisServer) -> None:
    store = (tmp_path / "store").as_uri()
    env = {
        **base_env(private_redis.url, store, emulator_time_scale=1, log_dir=tmp_path / "logs"),
        "TMPDIR": str(tmp_path),
    }
    write_prompts(tmp_path / "slow.jsonl", 200)
    output = tmp_path / "run.out"
    proc = subprocess.Popen(
        ["genfleet", "run", str(tmp_path / "slow.jsonl"), "--batch-size", "20"],
        env=env,
        cwd=ROOT,
        stdout=output.open("wb"),
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    try:
        client = private_redis.client()

        def running() -> bool:
            if proc.poll() is not None:
                raise AssertionError(output.read_text(errors="replace"))
            return bool(client.hlen(keys.running_key()))

        wait_for(running, 90, "a batch to be running", 0.2)
        assert len(processes_with_env(f"GENFLEET_STORE={store}")) >= 3  # run, workers, engine
        private_redis.kill()
        proc.wait(timeout=150)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 2, output.read_text(errors="replace")
    wait_for(
        lambda: not processes_with_env(f"GENFLEET_STORE={store}"),
        30,
        "every process the run started to be gone",
        0.2,
    )
