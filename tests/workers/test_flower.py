"""Flower, for real: behind basic auth, against the test Redis, with a real GPU worker and the
control worker's beat. Its API lists genfleet's tasks with readable results, and a headless
Chromium loads its tasks page and finds a power_watch result there.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest

from genfleet.common.settings import Settings
from genfleet.producer.enqueue import enqueue_run, reader_options
from tests.conftest import ROOT, Worker, base_env, free_port, wait_for

pytestmark = [pytest.mark.integration, pytest.mark.slow]

USER, PASSWORD = "genfleet", "flower-test-pw"


@pytest.fixture
def flower(tmp_path: Path, redis_url: str) -> Iterator[str]:
    port = free_port()
    env = base_env(redis_url, (tmp_path / "store").as_uri())
    log = (tmp_path / "flower.log").open("ab")
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "celery",
            "-A",
            "genfleet.workers.app",
            "flower",
            f"--port={port}",
            "--address=127.0.0.1",
            f"--basic-auth={USER}:{PASSWORD}",
            "--persistent=True",
            f"--db={tmp_path / 'flower.db'}",
        ],
        env=env,
        cwd=ROOT,
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    url = f"http://127.0.0.1:{port}"

    def up() -> bool:
        try:
            return httpx.get(f"{url}/healthcheck", timeout=1).status_code == 200
        except httpx.TransportError:
            return False

    wait_for(up, 30, "Flower to answer")
    yield url
    os.killpg(proc.pid, signal.SIGTERM)
    proc.wait(timeout=20)


def api_tasks(url: str, name: str) -> dict[str, Any]:
    response = httpx.get(
        f"{url}/api/tasks", params={"taskname": name}, auth=(USER, PASSWORD), timeout=5
    )
    response.raise_for_status()
    data: dict[str, Any] = response.json()
    return data


def test_flower_shows_genfleet_tasks_behind_auth(
    tmp_path: Path, redis_url: str, flower: str, start_worker: Callable[..., Worker]
) -> None:
    store = (tmp_path / "store").as_uri()
    env = base_env(redis_url, store, power_watch_interval_s=2, reaper_interval_s=5)
    gpu = start_worker(env)
    start_worker(env, role="control")
    settings = Settings(redis_url=redis_url, store=store, batch_size=25)
    source = tmp_path / "p.jsonl"
    source.write_bytes(b"".join(orjson.dumps({"prompt": f"q{i}"}) + b"\n" for i in range(50)))
    enqueue_run(settings, "flowerrun", str(source), reader_options(settings))
    gpu.wait_ready()

    # auth is required for the UI and the API
    assert httpx.get(f"{flower}/api/tasks", timeout=5).status_code == 401

    def batches_done() -> dict[str, Any] | None:
        tasks = api_tasks(flower, "genfleet.generate_batch")
        done = [t for t in tasks.values() if t.get("state") == "SUCCESS"]
        return tasks if len(done) == 2 else None

    tasks = wait_for(batches_done, 90, "two generate_batch successes in Flower", 0.5)
    result = next(iter(tasks.values()))["result"]
    summary = result if isinstance(result, dict) else eval_result(result)
    assert summary["run"] == "flowerrun"
    assert summary["prompts"] == 25 and summary["completion_tokens"] > 0
    assert summary["worker"] == gpu.hostname

    watches = wait_for(
        lambda: [
            t
            for t in api_tasks(flower, "genfleet.power_watch").values()
            if t.get("state") == "SUCCESS"
        ],
        60,
        "a power_watch result in Flower",
        0.5,
    )
    assert "verdicts" in str(watches[0]["result"])

    chromium = shutil.which("chromium") or shutil.which("chromium-browser")
    if chromium is None:
        if os.environ.get("CI"):
            raise AssertionError("chromium is not installed")
        pytest.skip("chromium is not installed")
    host = flower.removeprefix("http://")
    dom = subprocess.run(
        [
            chromium,
            "--headless",
            "--no-sandbox",
            "--disable-gpu",
            "--disable-quic",
            "--no-first-run",
            "--disable-background-networking",
            "--disable-component-update",
            "--disable-sync",
            f"--user-data-dir={tmp_path / 'chromium'}",
            "--virtual-time-budget=10000",
            "--dump-dom",
            f"http://{USER}:{PASSWORD}@{host}/tasks",
        ],
        capture_output=True,
        text=True,
        timeout=90,
        check=False,
    ).stdout
    assert "genfleet.power_watch" in dom, dom[-2000:]
    assert "genfleet.generate_batch" in dom


def eval_result(text: str) -> dict[str, Any]:
    """Flower shows results as their repr; ours are JSON-safe dicts of plain values."""
    import ast

    value = ast.literal_eval(text)
    assert isinstance(value, dict)
    return value
