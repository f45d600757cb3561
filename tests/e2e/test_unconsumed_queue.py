"""A run whose queue no live worker consumes is told at once (enqueue, status), naming its
queue and model and the queues the workers do consume; a run the fleet serves is not."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import orjson
import pytest
import redis

from genfleet.common.settings import Settings
from genfleet.common.store import open_store
from genfleet.producer.commands import queue_check, watch_run
from genfleet.producer.status import stall_reason, unconsumed_queue
from harness.env import base_env
from harness.processes import Worker
from harness.waits import wait_for
from tests.support.commands import invoke

pytestmark = pytest.mark.integration


@pytest.mark.parametrize(
    ("queue", "engine", "consumers", "loading", "expected"),
    [
        ("gpu.emulator", "emulator", {"w@h": ["control", "gpu.emulator"]}, {}, None),
        ("gpu.q3", "sglang", None, {}, None),  # the workers could not be asked: no claim
        (
            "gpu.q3",
            "sglang",
            {"w@h": ["gpu.emulator"], "c@h": ["control"]},
            {},
            ["gpu.emulator"],
        ),
        ("gpu.q3", "sglang", {}, {}, []),
        ("gpu.emulator", "emulator", {"w@h": ["gpu.q3"]}, {}, ["gpu.q3"]),
        # a worker loading its engine for the queue: its orders wait for it, nobody is told
        ("gpu.q3", "sglang", {"c@h": ["control"]}, {"w@h": "gpu.q3"}, None),
        ("gpu.q3", "sglang", {}, {"w@h": "gpu.q3"}, None),
        # one loading for another model does not serve this one
        ("gpu.q3", "sglang", {"c@h": ["control"]}, {"w@h": "gpu.emulator"}, []),
    ],
)
def test_unconsumed_queue(
    queue: str,
    engine: str,
    consumers: dict[str, list[str]] | None,
    loading: dict[str, str],
    expected: list[str] | None,
) -> None:
    model = "emulator" if engine == "emulator" else "q3"
    found = unconsumed_queue(queue, model, engine, "gpu", consumers, loading)
    if expected is None:
        assert found is None
        return
    assert found is not None
    assert (found["queue"], found["model"], found["worker_queues"]) == (queue, model, expected)
    assert queue in found["message"] and all(q in found["message"] for q in expected)
    start = "--engine emulator" if engine == "emulator" else "--model q3"
    assert f"genfleet worker {start}" in found["message"]


@pytest.mark.parametrize(
    ("consumers", "refused", "held_by"),
    [
        ({"a@h": ["gpu.emulator"]}, {}, None),  # a worker serves the run
        ({"a@h": ["gpu.emulator"]}, {"a@h": "quantization: …"}, ["a@h"]),
        # one of two refused: the other serves it
        ({"a@h": ["gpu.emulator"], "b@h": ["gpu.emulator"]}, {"a@h": "quantization: …"}, None),
        (
            {"a@h": ["gpu.emulator"], "b@h": ["gpu.emulator"], "c@h": ["control"]},
            {"a@h": "quantization: …", "b@h": "reasoning_parser: …", "gone@h": "…"},
            ["a@h", "b@h"],
        ),
    ],
)
def test_orders_are_held_when_every_worker_of_the_queue_refused_the_runs_model(
    consumers: dict[str, list[str]], refused: dict[str, str], held_by: list[str] | None
) -> None:
    found = unconsumed_queue("gpu.emulator", "emulator", "emulator", "gpu", consumers, {}, refused)
    if held_by is None:
        assert found is None
        return
    assert found is not None and found["held"] is True
    assert list(found["refused_by"]) == held_by
    assert "no worker serves the run's model" in found["message"]
    assert all(refused[w] in found["message"] for w in held_by)


def test_stall_reason_names_the_unconsumed_queue_first() -> None:
    found = unconsumed_queue("gpu.q3", "q3", "sglang", "gpu", {"w@h": ["gpu.emulator"]})
    reason = stall_reason(
        {"batches_failed": 0},
        still_s=300,
        workers_seen={"w@h": 990.0},
        findings=[],
        queue_depth=3,
        now=1000.0,
        unconsumed=found,
    )
    assert "no live worker consumes queue gpu.q3" in reason


class Told(Exception):
    """The warning was given: ends the watch."""


def cli(*args: str, env: dict[str, str]) -> Any:
    result = invoke(*args, env=env)
    assert result.exit_code == 0, result.output
    return orjson.loads(result.stdout)


def test_a_run_for_a_model_no_worker_serves_is_told(
    tmp_path: Path,
    redis_url: str,
    redis_client: redis.Redis,
    start_worker: Callable[..., Worker],
    capsys: pytest.CaptureFixture[str],
) -> None:
    store_url = (tmp_path / "store").as_uri()
    source = tmp_path / "p.jsonl"
    source.write_bytes(b"".join(orjson.dumps({"prompt": f"q{i}"}) + b"\n" for i in range(6)))
    env = {"GENFLEET_REDIS_URL": redis_url, "GENFLEET_STORE": store_url}
    worker = start_worker(base_env(redis_url, store_url))  # the emulator: gpu.emulator
    worker.wait_ready()

    other = cli("enqueue", str(source), "--run", "other", "--model", "qwen3", "--json", env=env)
    assert other["queue"] == "gpu.qwen3"
    warning = other["unconsumed"]
    assert warning is not None
    assert (warning["queue"], warning["model"]) == ("gpu.qwen3", "qwen3")
    assert warning["worker_queues"] == ["gpu.emulator"]
    assert "gpu.qwen3" in warning["message"] and "gpu.emulator" in warning["message"]

    status = cli("status", "other", "--json", env=env)
    assert status["state"] == "queued"
    assert status["unconsumed"]["queue"] == "gpu.qwen3"
    assert status["unconsumed"]["worker_queues"] == ["gpu.emulator"]
    assert redis_client.llen("gpu.qwen3") == 1  # its order waits, untouched
    check = queue_check(Settings.from_overrides({"redis_url": redis_url, "store": store_url}))
    told = invoke("status", "other", env=env)
    assert told.exit_code == 0, told.output
    line = " ".join(told.stderr.split())
    assert "no live worker consumes queue gpu.qwen3 (model qwen3)" in line, line
    assert "workers consume: gpu.emulator" in line, line

    # `status --watch` (and `run`'s wait) says it within seconds of nothing moving
    said: list[str] = []

    def told_yet() -> None:
        said.append(" ".join(capsys.readouterr().err.split()))
        if "no live worker consumes queue gpu.qwen3 (model qwen3)" in "".join(said):
            raise Told
        assert time.monotonic() < deadline, said

    deadline = time.monotonic() + 30
    with pytest.raises(Told):
        watch_run(open_store(store_url), redis_client, "other", told_yet, 300, "gpu", check)
    assert "workers consume: gpu.emulator" in "".join(said)

    served = cli("enqueue", str(source), "--run", "served", "--json", env=env)
    assert served["queue"] == "gpu.emulator"
    assert served["unconsumed"] is None
    wait_for(
        lambda: cli("status", "served", "--json", env=env)["state"] == "done",
        60,
        "run served to finish",
        0.5,
    )
    assert cli("status", "served", "--json", env=env)["unconsumed"] is None


def test_a_worker_loading_its_engine_is_not_told_to_start(
    tmp_path: Path,
    redis_url: str,
    redis_client: redis.Redis,
    start_worker: Callable[..., Worker],
) -> None:
    """An engine loads for minutes and its worker does not consume meanwhile: a run enqueued
    for it is not told "no live worker consumes its queue, start one", while a run for a model
    nobody loads is; once the loading worker is dead and silent, its queue is unconsumed."""
    store_url = (tmp_path / "store").as_uri()
    source = tmp_path / "p.jsonl"
    source.write_bytes(b"".join(orjson.dumps({"prompt": f"q{i}"}) + b"\n" for i in range(4)))
    # Summaries are fresh for 3 s (three power-watch rounds of 1 s).
    watch = {"GENFLEET_POWER_WATCH_INTERVAL_S": "1", "GENFLEET_SAMPLE_INTERVAL_S": "0.2"}
    env = {"GENFLEET_REDIS_URL": redis_url, "GENFLEET_STORE": store_url, **watch}
    worker = start_worker(
        {**base_env(redis_url, store_url, emulator_load_s=120, startup_timeout_s=300), **watch}
    )
    wait_for(
        lambda: redis_client.hexists("genfleet:summaries", worker.hostname),
        60,
        "the loading worker's first summary",
        0.2,
    )
    summary = orjson.loads(redis_client.hget("genfleet:summaries", worker.hostname) or b"{}")
    assert (summary["ok"], summary["queue"]) == (False, "gpu.emulator")

    served = cli("enqueue", str(source), "--run", "served", "--json", env=env)
    assert served["queue"] == "gpu.emulator"
    assert served["unconsumed"] is None, served["unconsumed"]
    assert cli("status", "served", "--json", env=env)["unconsumed"] is None
    other = cli("enqueue", str(source), "--run", "other", "--model", "q3", "--json", env=env)
    assert other["unconsumed"] is not None and other["unconsumed"]["queue"] == "gpu.q3"

    worker.kill()  # dies loading: its summary stays, and goes stale
    worker.proc.wait(timeout=10)
    wait_for(
        lambda: cli("status", "served", "--json", env=env)["unconsumed"] is not None,
        30,
        "the dead worker's queue to be unconsumed",
        0.5,
    )
    told = cli("status", "served", "--json", env=env)["unconsumed"]
    assert told["queue"] == "gpu.emulator" and "no worker answered" in told["message"]

    # A worker that consumes stops saying it is starting (the power-watch samples it).
    ready = start_worker({**base_env(redis_url, store_url), **watch})
    ready.wait_ready()

    def sampled() -> bool:
        summary = orjson.loads(redis_client.hget("genfleet:summaries", ready.hostname) or b"{}")
        return bool(summary) and summary.get("ok", True) is not False

    wait_for(sampled, 10, "the consuming worker's summary", 0.2)
