"""A staging interrupted for real, then the same command with edited data.

The producer is SIGKILLed once its first orders are out, a worker SIGKILLed once it has
checkpointed part of a batch; the same `genfleet enqueue` with 40 prompts edited is then
refused, naming the difference, and touches nothing. Deleting the run and staging the edited
data gives a clean run: every record answers its new prompt, and nothing of the interrupted
staging reaches it. Real Redis, moto's S3 server, real CLI and worker processes.
"""

from __future__ import annotations

import os
import signal
import subprocess
from collections.abc import Callable
from pathlib import Path

import orjson
import pytest
import redis

from genfleet.common import keys
from harness.assertions import assert_exactly_once
from harness.env import ROOT, base_env
from harness.processes import Worker
from harness.runs import fault_settings, open_run_store, wait_batch_running, wait_run_done
from harness.sources import write_prompts
from harness.waits import wait_for

pytestmark = [pytest.mark.fault, pytest.mark.integration, pytest.mark.slow]

RUN = "edited"
PROMPTS = 1000
EDITED = {i: f"Edited question {i}: what is {i} times {i}?" for i in range(0, PROMPTS, 25)}


def genfleet(args: list[str], env: dict[str, str]) -> subprocess.Popen[bytes]:
    return subprocess.Popen(
        ["genfleet", *args],
        env=env,
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
    )


def finished(proc: subprocess.Popen[bytes], timeout_s: float = 120) -> tuple[int, str]:
    out, _ = proc.communicate(timeout=timeout_s)
    return proc.returncode, " ".join(out.decode(errors="replace").split())


def test_an_interrupted_staging_is_not_finished_with_edited_data(
    tmp_path: Path,
    redis_url: str,
    redis_client: redis.Redis,
    s3_server: str,
    s3_store_url: str,
    start_worker: Callable[..., Worker],
) -> None:
    assert len(EDITED) == 40
    env = base_env(
        redis_url,
        s3_store_url,
        s3_endpoint_url=s3_server,
        lease_ttl_s=3,
        log_dir=tmp_path,
        emulator_time_scale=4,
        checkpoint_interval_s=0.5,
    )
    settings = fault_settings(redis_url, s3_store_url, s3_endpoint_url=s3_server)
    store = open_run_store(settings)
    data = tmp_path / "prompts.jsonl"
    write_prompts(data, PROMPTS)
    command = ["enqueue", str(data), "--run", RUN, "--batch-size", "25", "--max-tokens", "256"]
    # At the emulator's own pace: its one batch (the producer dies after its first orders)
    # must still run when the test looks for its first checkpoint; at 4 times it ended in 0.95 s.
    doomed = start_worker({**env, "GENFLEET_EMULATOR_TIME_SCALE": "1"}, name="doomed")
    doomed.wait_ready()

    producer = genfleet(command, env)
    wait_for(
        lambda: (
            redis_client.llen("gpu.emulator") + redis_client.hlen(keys.UNACKED) > 0
            or producer.poll() is not None
        ),
        60,
        "the producer's first orders",
        0.005,
    )
    os.kill(producer.pid, signal.SIGKILL)
    producer.wait(timeout=10)
    assert not store.exists(keys.manifest_key(RUN)), "staging finished before the kill"

    wait_batch_running(
        redis_client, store, RUN, doomed.hostname, checkpointed=True, interval_s=0.02
    )
    doomed.kill(signal.SIGKILL)
    doomed.proc.wait(timeout=10)
    inputs = {k: store.get(k) for k in store.list(f"{RUN}/inputs/")}

    # The same command, 40 prompts edited: refused, naming the difference; nothing touched.
    ids = write_prompts(data, PROMPTS, marked=EDITED)
    code, message = finished(genfleet(command, env))
    assert code == 2, message
    assert "prompts: the run holds" in message and "interrupted staging" in message
    assert "first difference: batch-000000, prompt 'p00000'" in message
    assert not store.exists(keys.manifest_key(RUN))
    assert {k: store.get(k) for k in store.list(f"{RUN}/inputs/")} == inputs

    # Starting over is explicit: delete, then the same command stages the edited data.
    code, message = finished(genfleet(["delete", RUN, "--yes"], env))
    assert code == 0, message
    code, message = finished(genfleet(command, env))
    assert code == 0, message
    start_worker({**env, "GENFLEET_EMULATOR_TIME_SCALE": "200"}, name="fresh").wait_ready()
    wait_run_done(settings, redis_client, RUN, 120, store)

    _, rows = assert_exactly_once(settings, RUN, ids, redis_client, store)
    asked = {
        row["id"]: row["messages"] for row in map(orjson.loads, data.read_bytes().splitlines())
    }
    wrong = [row["id"] for row in rows if row["messages"] != asked[row["id"]]]
    assert wrong == [], f"{len(wrong)} records answer another prompt: {wrong[:5]}"
    # The killed worker's checkpoint answered the old prompts: none of it is in the new run.
    assert all(row["engine"]["worker"] != doomed.hostname for row in rows)
