"""Flower, for real, as a person sees it: `genfleet flower` behind basic auth against the test
Redis, a real GPU worker (emulator) and the control worker's beat. Its API lists genfleet's
tasks with their figures; headless Chromium loads the Tasks page and reads, without a click,
the power-watch line that names an underused GPU and its cause, and no such line on a
saturated run.

Set GENFLEET_FLOWER_SCREENSHOT=docs/flower-tasks.png to keep the underused page's screenshot.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from genfleet.common.settings import Settings
from harness.env import ROOT, base_env, free_port
from harness.processes import Worker
from harness.runs import stage_questions
from harness.waits import wait_for

pytestmark = [pytest.mark.integration, pytest.mark.slow]

USER, PASSWORD = "genfleet", "flower-test-pw"
# How the power-watch sees a GPU within seconds (see test_power_watch_integration).
WATCH = {
    "power_window_s": 3,
    "sample_interval_s": 0.25,
    "emulator_time_scale": 4,
    "emulator_mean_completion_tokens": 400,
    "max_tokens": 1024,
}
UNDERUSED_LINE = re.compile(r"\d+ % of \d+ W, client_limited — [^|<]*raise --max-inflight")


@pytest.fixture
def flower(tmp_path: Path, redis_url: str) -> Iterator[str]:
    port = free_port()
    env = {
        **base_env(redis_url, (tmp_path / "store").as_uri()),
        "FLOWER_BASIC_AUTH": f"{USER}:{PASSWORD}",
    }
    log = (tmp_path / "flower.log").open("ab")
    proc = subprocess.Popen(
        [sys.executable, "-m", "genfleet.workers", "flower", "--port", str(port)]
        + ["--db", str(tmp_path / "flower.db")],
        env=env,
        cwd=ROOT,
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    url = f"http://127.0.0.1:{port}"

    def up() -> bool:
        if proc.poll() is not None:
            raise AssertionError((tmp_path / "flower.log").read_text(errors="replace"))
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


def watch_results(url: str) -> list[str]:
    """The results of the power-watch rounds Flower knows, as it received them."""
    tasks = api_tasks(url, "genfleet.power_watch").values()
    return [str(t["result"]) for t in tasks if t.get("state") == "SUCCESS"]


def chromium() -> str:
    found = shutil.which("chromium") or shutil.which("chromium-browser")
    if found is None:
        if os.environ.get("CI"):
            raise AssertionError("chromium is not installed")
        pytest.skip("chromium is not installed")
    return found


def browse(url: str, page: str, tmp_path: Path, screenshot: Path | None = None) -> str:
    """The Tasks page as headless Chromium renders it (after its table loaded), no clicks."""
    host = url.removeprefix("http://")
    args = [
        chromium(),
        "--headless",
        "--no-sandbox",
        "--disable-gpu",
        "--disable-quic",
        "--no-first-run",
        "--disable-background-networking",
        "--disable-component-update",
        "--disable-sync",
        "--hide-scrollbars",
        f"--user-data-dir={tmp_path / 'chromium'}",
        "--virtual-time-budget=10000",
    ]
    address = f"http://{USER}:{PASSWORD}@{host}{page}"

    def run(*extra: str) -> str:
        done = subprocess.run(
            [*args, *extra, address], capture_output=True, text=True, timeout=90, check=False
        )
        return done.stdout

    dom = run("--dump-dom")
    if screenshot is not None:
        run(f"--screenshot={screenshot}", "--window-size=1500,760")
    return dom


def test_flower_shows_genfleet_tasks_behind_auth(
    tmp_path: Path, redis_url: str, flower: str, start_worker: Callable[..., Worker]
) -> None:
    store = (tmp_path / "store").as_uri()
    env = base_env(redis_url, store, power_watch_interval_s=2, reaper_interval_s=5)
    gpu = start_worker(env)
    start_worker(env, role="control")
    settings = Settings(redis_url=redis_url, store=store, batch_size=25)
    stage_questions(settings, "flowerrun", tmp_path, 50)
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
    # the line a person reads, then every figure
    assert summary["run"] == "flowerrun"
    assert summary["prompts"] == 25 and summary["completion_tokens"] > 0
    assert summary["worker"] == gpu.hostname
    assert summary["summary"].startswith(f"flowerrun/{summary['batch']}: 25 prompts, ")
    assert f"{summary['completion_tokens']:,} tok" in summary["summary"]

    watches = wait_for(lambda: watch_results(flower), 60, "a power_watch result in Flower", 0.5)
    assert watches[0].startswith("{'summary': 'fleet") and "verdicts" in watches[0]

    dom = browse(flower, "/tasks", tmp_path)
    assert "genfleet.power_watch" in dom, dom[-2000:]
    assert "genfleet.generate_batch" in dom
    # the Result column shows the lines, not the dicts behind them
    assert f"flowerrun/{summary['batch']}: 25 prompts, " in dom
    assert "{'summary'" not in dom and "'verdicts'" not in dom


def test_tasks_page_names_an_underused_gpu_and_its_cause(
    tmp_path: Path, redis_url: str, flower: str, start_worker: Callable[..., Worker]
) -> None:
    store = (tmp_path / "store").as_uri()
    env = base_env(redis_url, store, max_inflight=2, power_watch_interval_s=1, **WATCH)
    gpu = start_worker(env)
    start_worker(env, role="control")
    settings = Settings(redis_url=redis_url, store=store, batch_size=20, **WATCH)
    stage_questions(settings, "slow", tmp_path, 200, prefix="slow question ")
    gpu.wait_ready()

    def flagged() -> list[str]:
        return [r for r in watch_results(flower) if UNDERUSED_LINE.search(r)]

    wait_for(flagged, 90, "a power-watch round flagging the GPU in Flower", 0.5)
    keep = os.environ.get("GENFLEET_FLOWER_SCREENSHOT")
    shot = tmp_path / "flower-tasks.png"
    dom = browse(flower, "/tasks", tmp_path, screenshot=shot)
    # on the page as rendered, without opening a task: the fleet line and the GPU's line
    assert "1 of 1 GPU underused: client_limited" in dom, dom[-3000:]
    line = UNDERUSED_LINE.search(dom)
    assert line is not None, dom[-3000:]
    assert gpu.hostname in dom
    assert shot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    if keep:
        shutil.copyfile(shot, ROOT / keep)


def test_tasks_page_of_a_saturated_run_flags_no_gpu(
    tmp_path: Path, redis_url: str, flower: str, start_worker: Callable[..., Worker]
) -> None:
    from genfleet.workers.app import app
    from genfleet.workers.observe.power_watch import run_power_watch

    store = (tmp_path / "store").as_uri()
    env = base_env(redis_url, store, max_running_requests=48, power_watch_interval_s=1, **WATCH)
    gpu = start_worker(env)
    settings = Settings(redis_url=redis_url, store=store, batch_size=100, **WATCH)
    stage_questions(settings, "busy", tmp_path, 1500, prefix="busy question ")
    gpu.wait_ready()

    def saturated() -> bool:
        rows = run_power_watch(app, settings)["verdicts"]
        return bool(rows) and rows[0]["verdict"] == "ok" and (rows[0]["inflight"] or 0) >= 48

    # The beat starts once the engine is full: the rounds Flower shows judge a busy GPU.
    wait_for(saturated, 60, "the GPU to be saturated", 0.5)
    start_worker(env, role="control")
    rounds = wait_for(
        lambda: len(r := watch_results(flower)) >= 3 and r, 60, "three power-watch rounds", 0.5
    )
    dom = browse(flower, "/tasks?name=genfleet.power_watch", tmp_path)
    assert "0 of 1 GPU underused" in dom, dom[-3000:]
    assert UNDERUSED_LINE.search(dom) is None and "client_limited" not in dom
    assert all("; 0 of 1 GPU underused" in r for r in rounds), rounds


def test_worker_page_shows_an_engine_whose_restart_budget_is_spent(
    tmp_path: Path, redis_url: str, flower: str, start_worker: Callable[..., Worker]
) -> None:
    """A worker whose engine keeps dying takes no work, so no task result can say so: its
    own page in Flower (the worker's `stats`, which Flower renders) names the alarm."""
    store = (tmp_path / "store").as_uri()
    env = base_env(redis_url, store, emulator_fail_after_requests=10, restart_budget=0)
    broken = start_worker(env, name="broken")
    healthy = start_worker(base_env(redis_url, store), name="healthy")
    settings = Settings(redis_url=redis_url, store=store, batch_size=20)
    broken.wait_ready()
    healthy.wait_ready()
    stage_questions(settings, "crashing", tmp_path, 40, prefix="crashing question ")

    def stats(name: str) -> dict[str, Any]:
        response = httpx.get(
            f"{flower}/api/workers",
            params={"workername": name, "refresh": 1},
            auth=(USER, PASSWORD),
            timeout=10,
        )
        response.raise_for_status()
        data: dict[str, Any] = response.json().get(name, {}).get("stats") or {}
        return data

    def alarmed() -> str | None:
        line = str(stats(broken.hostname).get("genfleet_engine") or "")
        return line if line.startswith("RESTART BUDGET SPENT") else None

    line = wait_for(alarmed, 90, "Flower to show the spent restart budget", 1.0)
    assert "restart budget spent (" in line and "back in" in line, line
    assert str(stats(healthy.hostname).get("genfleet_engine")).startswith("ready: ")

    def page() -> str | None:
        response = httpx.get(f"{flower}/worker/{broken.hostname}", auth=(USER, PASSWORD))
        return response.text if response.status_code == 200 else None

    html = wait_for(page, 30, "Flower's page of the broken worker", 0.5)
    assert "genfleet_engine" in html and "RESTART BUDGET SPENT: restart budget spent" in html


def eval_result(text: str) -> dict[str, Any]:
    """Flower's API gives results as their repr; ours are dicts of plain values."""
    import ast

    value = ast.literal_eval(text)
    assert isinstance(value, dict)
    return value


def test_flower_off_loopback_refuses_to_start_without_auth(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if k != "FLOWER_BASIC_AUTH"}
    done = subprocess.run(
        [sys.executable, "-m", "genfleet.workers", "flower", "--address", "0.0.0.0"]
        + ["--port", str(free_port()), "--db", str(tmp_path / "flower.db")],
        env=env,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 2
    assert "FLOWER_BASIC_AUTH" in done.stderr
    assert not list(tmp_path.glob("flower.db*"))
