"""`worker --gpus 0,1 --tp-size 1`: a child worker that dies is restarted and reported, and the
run finishes on both."""

from __future__ import annotations

import os
import signal
from pathlib import Path
from typing import Any

import orjson
import pytest
import redis

from genfleet.common import keys
from genfleet.workers.process.children import restart_delay_s
from harness.assertions import assert_exactly_once
from harness.env import base_env, free_port
from harness.processes import Worker, child_pids, cmdline, pid_alive
from harness.runs import fault_settings, open_run_store, stage, wait_run_done
from harness.sources import write_prompts
from harness.waits import wait_for


@pytest.mark.parametrize(
    ("code", "restarts", "budget", "stopping", "delay"),
    [
        (-9, 0, 3, False, 0.5),  # killed: restart after the backoff
        (1, 2, 3, False, 2.0),  # the backoff doubles per restart
        (1, 3, 3, False, None),  # budget spent: let it go
        (0, 0, 3, False, None),  # a clean exit is not a death
        (-15, 0, 3, True, None),  # asked to stop: not a death either
    ],
)
def test_restart_delay(
    code: int, restarts: int, budget: int, stopping: bool, delay: float | None
) -> None:
    assert restart_delay_s(code, restarts, budget, stopping, 0.5) == delay


def index_of(pid: int) -> str | None:
    argv = cmdline(pid)
    return argv[argv.index(b"--worker-index") + 1].decode() if b"--worker-index" in argv else None


@pytest.mark.fault
@pytest.mark.integration
@pytest.mark.slow
def test_dead_child_worker_is_restarted_and_reported(
    tmp_path: Path, redis_url: str, redis_client: redis.Redis
) -> None:
    from genfleet.workers.app import app

    store_url = (tmp_path / "store").as_uri()
    env = base_env(redis_url, store_url, log_dir=tmp_path, port=free_port())
    log = tmp_path / "group.log"
    group = Worker(env, log, "grp@test", ["worker", "--gpus", "0,1", "--tp-size", "1"])
    children = [f"grp{i}@test" for i in range(2)]  # the group's name, numbered

    def answering() -> set[str]:
        replies = app.control.ping(destination=children, timeout=1) or []
        return {name for reply in replies for name in reply}

    def restarts() -> list[dict[str, Any]]:
        rows = [orjson.loads(f[b"finding"]) for _, f in redis_client.xrange(keys.findings_key())]
        return [r for r in rows if r["cause"] == "worker_restarted"]

    try:
        wait_for(lambda: answering() == set(children), 90, "both children ready", 0.2)
        first = next(p for p in child_pids(group.proc.pid) if index_of(p) == "0")
        os.kill(first, signal.SIGKILL)
        wait_for(lambda: not pid_alive(first), 10, "the child to die")
        restarted = wait_for(restarts, 20, "the restart to be reported")
        assert len(restarted) == 1 and restarted[0]["numbers"]["exit_code"] == -9
        now = wait_for(
            lambda: [p for p in child_pids(group.proc.pid) if index_of(p) == "0" and pid_alive(p)],
            30,
            "a new child 0",
        )
        assert first not in now
        wait_for(lambda: answering() == set(children), 90, "the new child ready", 0.2)

        ids = write_prompts(tmp_path / "prompts.jsonl", 100)
        settings = fault_settings(redis_url, store_url)
        store = open_run_store(settings)
        stage(settings, "children", tmp_path / "prompts.jsonl")
        wait_run_done(settings, redis_client, "children", 120, store)
        assert_exactly_once(settings, "children", ids, redis_client, store)
        assert group.proc.poll() is None
    finally:
        group.stop()
