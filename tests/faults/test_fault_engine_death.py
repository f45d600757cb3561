"""A prompt that kills the engine as it arrives, on an engine genfleet has never seen: a user's
`--engine command` that streams its answers and exits on receipt of one prompt, printing no
error line, in every manner the death can meet the request (before the answer's headers,
after them, after the first event with no text yet, after closing the connection so that the
client sees it closed before the process exits) and with every kind of exit (code 0, code 1,
a signal it raises on itself).

Two real workers, batches of 50, a restart budget of 5 in an hour with a 600 s cool-down (a
spent budget stalls the run past the test's deadline): the prompt must become its one error
record (`engine_crash`) within the budget, every other prompt answered exactly once, no batch
failed, and both workers still consuming.
"""

from __future__ import annotations

import os
import signal
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import redis

from genfleet.common import keys
from harness.assertions import assert_exactly_once
from harness.control import consuming
from harness.env import base_env, free_port
from harness.processes import Worker
from harness.runs import fault_settings, open_run_store, stage, wait_run_done
from harness.sources import write_prompts
from harness.waits import wait_for
from tests.fakes import http_engine

pytestmark = [pytest.mark.fault, pytest.mark.integration, pytest.mark.slow]

POISON = "KILLS-THE-ENGINE"
MODEL = "dying"


def dying_engine_command(when: str, how: str, sends: Path) -> str:
    """The `--engine-command` of an engine that dies on receipt of POISON (see
    `tests.fakes.http_engine.DyingEngine`), logging each chat request it receives to `sends`."""
    argv = [sys.executable, str(Path(http_engine.__file__).resolve()), "{port}"]
    argv += ["--die-on", POISON, "--die-when", when, "--die-how", how, "--sends", str(sends)]
    return " ".join(argv)


def poison_sends(sends: Path, after: float = 0.0) -> int:
    """How many times an engine received the poison (after monotonic time `after`)."""
    if not sends.exists():
        return 0
    lines = sends.read_text().splitlines()
    return sum(1 for line in lines if POISON in line and float(line.split()[0]) > after)


@pytest.mark.parametrize(
    ("when", "how"),
    [
        ("received", "1"),
        ("headers", "0"),
        ("role", "segv"),
        ("closed", "1"),
    ],
)
def test_an_engine_that_dies_on_receipt_of_a_prompt_costs_its_record_and_no_worker(
    tmp_path: Path,
    redis_url: str,
    redis_client: redis.Redis,
    start_worker: Callable[..., Worker],
    when: str,
    how: str,
) -> None:
    store_url = (tmp_path / "store").as_uri()
    sends = tmp_path / "sends.txt"
    command = dying_engine_command(when, how, sends)
    engine = {"engine": "command", "engine_command": command, "served_model_name": MODEL}
    env = base_env(
        redis_url,
        store_url,
        **engine,
        restart_budget=5,
        restart_window_s=3600,
        restart_cooldown_s=600,
        log_dir=tmp_path,
    )
    workers = [start_worker({**env, "GENFLEET_PORT": str(free_port())}) for _ in range(2)]
    for worker in workers:
        worker.wait_ready()
    poison = 157
    source = tmp_path / "prompts.jsonl"
    ids = write_prompts(source, 200, marked={poison: f"{POISON}: what is 1 + 1?"})
    settings = fault_settings(redis_url, store_url, batch_size=50, **engine)
    store = open_run_store(settings)
    stage(settings, "dying", source)
    wait_run_done(settings, redis_client, "dying", 75, store)

    _result, rows = assert_exactly_once(settings, "dying", ids, redis_client, store)
    errors = [row for row in rows if row["error"] is not None]
    assert [row["id"] for row in errors] == [ids[poison]]
    assert errors[0]["error"]["type"] == "engine_crash"
    assert not redis_client.hgetall(keys.failed_key("dying"))
    # Within one worker's restart budget: at most one death per restart, and one more.
    assert poison_sends(sends) <= 5
    for worker in workers:
        assert consuming(worker.hostname) == [f"gpu.{MODEL}"], worker.tail()


def test_a_prompts_deaths_follow_its_batch_to_the_next_worker(
    tmp_path: Path,
    redis_url: str,
    redis_client: redis.Redis,
    start_worker: Callable[..., Worker],
) -> None:
    """The first worker's engine dies twice with the poison arriving, and the worker is lost
    while its engine restarts (a slow restart: 5 s). The batch goes to the next worker with
    its deaths: there the poison is sent alone first, and its first death blames it."""
    store_url = (tmp_path / "store").as_uri()
    sends = tmp_path / "sends.txt"
    command = dying_engine_command("received", "1", sends)
    engine = {"engine": "command", "engine_command": command, "served_model_name": MODEL}
    env = base_env(
        redis_url,
        store_url,
        **engine,
        restart_budget=5,
        restart_cooldown_s=600,
        lease_ttl_s=3,
        reaper_interval_s=1,
        log_dir=tmp_path,
    )
    start_worker(env, role="control").wait_ready()
    slow = {**env, "GENFLEET_PORT": str(free_port()), "GENFLEET_RESTART_BACKOFF_S": "5"}
    first = start_worker(slow, name="first")
    first.wait_ready()
    poison = 7
    source = tmp_path / "prompts.jsonl"
    ids = write_prompts(source, 100, marked={poison: f"{POISON}: what is 1 + 1?"})
    settings = fault_settings(redis_url, store_url, batch_size=50, **engine)
    store = open_run_store(settings)
    stage(settings, "moved", source)
    evidence = keys.crash_evidence_key("moved", keys.batch_id(0))
    field = f"0:{ids[poison]}"
    wait_for(lambda: int(redis_client.hget(evidence, field) or 0) >= 2, 60, "two deaths", 0.05)
    os.killpg(first.proc.pid, signal.SIGKILL)  # its engine dies with it (parent death)
    lost_at = time.monotonic()
    assert poison_sends(sends) == 2
    second = start_worker({**env, "GENFLEET_PORT": str(free_port())}, name="second")
    second.wait_ready()
    wait_run_done(settings, redis_client, "moved", 75, store)

    _result, rows = assert_exactly_once(settings, "moved", ids, redis_client, store)
    errors = [row for row in rows if row["error"] is not None]
    assert [row["id"] for row in errors] == [ids[poison]]
    assert errors[0]["error"]["type"] == "engine_crash"
    assert poison_sends(sends, after=lost_at) == 1  # alone, once: blamed at its first death
    assert not redis_client.hgetall(keys.failed_key("moved"))
    assert not redis_client.exists(evidence)  # cleared with the batch's output
    assert consuming(second.hostname) == [f"gpu.{MODEL}"], second.tail()
