"""The power-watch's word at the end of a run: draining is not underuse, a slow producer is.

`genfleet run` at full load and the README demo run with a beat every second and a short
power window, so the watch judges the run every second: no finding may come of it, and the
beat's own results (in the result backend) show no verdict but ok, starting, draining or
idle. A producer that stages slower than the fleet works still gets `starved`.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import orjson
import pytest
import redis

from genfleet.common.settings import Settings
from genfleet.common.store import open_store
from genfleet.producer.enqueue import enqueue_run, reader_options
from genfleet.producer.status import run_status
from genfleet.workers.observe.power_watch import run_power_watch
from harness.env import ROOT, base_env, free_port
from harness.processes import Worker
from harness.waits import wait_for
from tests.support.commands import genfleet

pytestmark = [pytest.mark.integration, pytest.mark.slow]

WATCH = {
    "power_watch_interval_s": 1,
    "power_window_s": 2,
    "sample_interval_s": 0.25,
    "emulator_time_scale": 5,
    "emulator_mean_completion_tokens": 400,
}


def beat_verdicts(client: redis.Redis) -> list[str]:
    """Every verdict the beat's power-watch reported (its task results in Redis)."""
    seen = []
    for key in client.scan_iter("celery-task-meta-*"):
        meta = orjson.loads(client.get(key) or b"{}")
        result = meta.get("result")
        if isinstance(result, dict) and "verdicts" in result:
            seen += [str(row.get("verdict")) for row in result["verdicts"]]
    return seen


@pytest.mark.parametrize(
    ("prompts", "args"),
    [(300, ["--batch-size", "100", "--max-running-requests", "48"]), (None, [])],
    ids=["full-load-300", "readme-demo"],
)
def test_a_run_ends_without_an_underuse_finding(
    prompts: int | None,
    args: list[str],
    tmp_path: Path,
    redis_url: str,
    redis_client: redis.Redis,
) -> None:
    source = ROOT / "examples/prompts.jsonl"
    if prompts is not None:
        source = tmp_path / "load.jsonl"
        source.write_bytes(
            b"".join(orjson.dumps({"prompt": f"question {i}"}) + b"\n" for i in range(prompts))
        )
    store = (tmp_path / "store").as_uri()
    env = base_env(redis_url, store, log_dir=tmp_path / "logs", port=free_port(), **WATCH)
    result = genfleet(["run", str(source), "--json", *args], env, timeout_s=300)
    assert result.returncode == 0, result.stdout + result.stderr
    summary = orjson.loads(result.stdout[result.stdout.index("{") :])
    assert summary["state"] == "done"
    assert summary["prompts_done"] == (prompts or 100)
    assert summary["findings"] == [], summary["findings"]
    verdicts = beat_verdicts(redis_client)
    assert verdicts, "the power-watch never judged the run"
    # the tail (draining), the ramp (starting) and full load (ok): never underused
    assert set(verdicts) <= {"ok", "starting", "draining", "idle"}, verdicts


class SlowSource:
    """A named pipe a thread writes a few prompts into every `every_s` seconds: a producer
    whose source is slower than the fleet, until `finish()`."""

    def __init__(self, path: Path, per_write: int, every_s: float) -> None:
        os.mkfifo(path)
        self.path = path
        self.written = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._write, args=(per_write, every_s))
        self._thread.start()

    def _write(self, per_write: int, every_s: float) -> None:
        with self.path.open("wb") as pipe:
            while True:
                lines = [
                    orjson.dumps({"prompt": f"slow {self.written + i}"}) + b"\n"
                    for i in range(per_write)
                ]
                pipe.write(b"".join(lines))
                pipe.flush()
                self.written += per_write
                if self._stop.wait(every_s):
                    return

    def finish(self) -> None:
        self._stop.set()
        self._thread.join(timeout=30)


def test_a_producer_slower_than_the_fleet_starves_it(
    tmp_path: Path, redis_url: str, start_worker: Callable[..., Worker]
) -> None:
    from genfleet.workers.app import app

    store = (tmp_path / "store").as_uri()
    watch = {**WATCH, "power_window_s": 3}
    worker = start_worker(base_env(redis_url, store, **watch))
    worker.wait_ready()
    settings = Settings(redis_url=redis_url, store=store, batch_size=4, **watch)
    source = SlowSource(tmp_path / "slow.jsonl", per_write=4, every_s=1.5)
    staged: dict[str, Any] = {}
    producer = threading.Thread(
        target=lambda: staged.update(
            result=enqueue_run(settings, "slow", str(source.path), reader_options(settings))
        )
    )
    producer.start()
    try:

        def starved() -> dict[str, Any] | None:
            report = run_power_watch(app, settings)
            found = [f for f in report["findings"] if f["worker"] == worker.hostname]
            return found[0] if found and found[0]["cause"] == "starved" else None

        finding = wait_for(starved, 60, "a 'starved' finding while the producer stages", 0.5)
        assert finding["run"] == "slow" or finding["run"] is None
        assert finding["numbers"]["staging"] == "slow"
        assert finding["numbers"]["power_w"] < 0.70 * finding["numbers"]["power_limit_w"]
    finally:
        source.finish()
        producer.join(timeout=60)
    assert staged["result"].prompts == source.written
    wait_for(
        lambda: (
            run_status(open_store(store), redis.Redis.from_url(redis_url), "slow")["state"]
            == "done"
        ),
        60,
        "the slow run to finish",
        0.3,
    )

    def settled() -> bool:  # staging is over: no starved finding once the run is done
        report = run_power_watch(app, settings)
        rows = [r for r in report["verdicts"] if r["worker"] == worker.hostname]
        return bool(rows) and rows[0]["verdict"] in ("idle", "draining", "ok")

    assert wait_for(settled, 30, "the worker's verdict after staging", 0.5)
