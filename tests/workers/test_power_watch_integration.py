"""The power-watch end to end: real workers with the emulator's simulated GPU pushing their
summaries, the real beat-task function, findings in the Redis stream.

A run fed one request at a time with MTP off is flagged underused because MTP is off; the
same with MTP on is flagged client-limited; a saturated run with MTP on is not flagged.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import redis

from genfleet.common import keys
from genfleet.common.settings import Settings
from genfleet.workers.observe.power_watch import run_power_watch
from harness.env import base_env
from harness.processes import Worker
from harness.runs import stage_questions
from harness.waits import wait_for

pytestmark = [pytest.mark.integration, pytest.mark.slow]

WATCH = {
    "power_window_s": 3,
    "sample_interval_s": 0.25,
    "emulator_time_scale": 4,
    "emulator_mean_completion_tokens": 400,
    "max_tokens": 1024,
}


def watch_until(
    settings: Settings, worker: str, predicate: Callable[[dict[str, Any]], bool]
) -> dict[str, Any]:
    """Run the power-watch until the worker's verdict row satisfies `predicate`."""
    from genfleet.workers.app import app

    def check() -> dict[str, Any] | None:
        report = run_power_watch(app, settings)
        rows = [r for r in report["verdicts"] if r["worker"] == worker]
        return report if rows and predicate(rows[0]) else None

    result: dict[str, Any] = wait_for(check, 60, f"a power-watch verdict for {worker}", 0.5)
    return result


@pytest.mark.parametrize(
    ("mtp", "cause"),
    [(False, "mtp_off"), (True, "client_limited")],
)
def test_concurrency_one_is_underused_with_its_cause(
    mtp: bool,
    cause: str,
    tmp_path: Path,
    redis_url: str,
    redis_client: redis.Redis,
    start_worker: Callable[..., Worker],
) -> None:
    store = (tmp_path / "store").as_uri()
    env = base_env(redis_url, store, mtp=str(mtp).lower(), max_inflight=1, **WATCH)
    worker = start_worker(env)
    settings = Settings(redis_url=redis_url, store=store, batch_size=20, **WATCH)
    stage_questions(settings, "slow", tmp_path, 200, prefix="slow question ")
    worker.wait_ready()
    report = watch_until(settings, worker.hostname, lambda row: row["verdict"] == "underused")
    row = next(r for r in report["verdicts"] if r["worker"] == worker.hostname)
    assert row["cause"] == cause
    assert row["inflight_cap"] == 1
    assert row["power_w"] < 0.70 * row["power_limit_w"]
    finding = next(f for f in report["findings"] if f["worker"] == worker.hostname)
    assert finding["cause"] == cause and finding["suggestion"]
    assert finding["numbers"]["power_limit_w"] == row["power_limit_w"]
    # the finding went to the stream once; the next beat does not alert it again
    stream = redis_client.xrange(keys.findings_key())
    assert len(stream) == 1
    from genfleet.workers.app import app

    assert run_power_watch(app, settings)["new_findings"] == 0
    assert len(redis_client.xrange(keys.findings_key())) == 1


def test_saturated_run_with_mtp_is_not_flagged(
    tmp_path: Path,
    redis_url: str,
    start_worker: Callable[..., Worker],
) -> None:
    store = (tmp_path / "store").as_uri()
    env = base_env(redis_url, store, max_running_requests=48, batch_size=100, **WATCH)
    worker = start_worker(env)
    settings = Settings(redis_url=redis_url, store=store, batch_size=100, **WATCH)
    stage_questions(settings, "busy", tmp_path, 1500, prefix="busy question ")
    worker.wait_ready()
    report = watch_until(
        settings,
        worker.hostname,
        lambda row: (
            row["inflight"] is not None
            and row["inflight"] >= 48
            and row["verdict"] == "ok"
            and row["accept_length"] is not None  # measured once decoding under MTP ran
        ),
    )
    row = next(r for r in report["verdicts"] if r["worker"] == worker.hostname)
    assert row["power_w"] >= 0.70 * row["power_limit_w"]
    assert row["accept_length"] > 1.5  # MTP on and effective: drafts are accepted
    assert not [f for f in report["findings"] if f["worker"] == worker.hostname]


def test_a_worker_that_stops_answering_is_a_finding(
    tmp_path: Path,
    redis_url: str,
    start_worker: Callable[..., Worker],
) -> None:
    from genfleet.workers.app import app

    store = (tmp_path / "store").as_uri()
    watch = {**WATCH, "power_watch_interval_s": 1}  # its summaries' TTL: 3 s
    worker = start_worker(base_env(redis_url, store, **watch))
    worker.wait_ready()
    settings = Settings(redis_url=redis_url, store=store, **watch)
    seen = wait_for(
        lambda: worker.hostname in run_power_watch(app, settings)["workers"], 30, "a first push"
    )
    assert seen
    worker.kill()  # no clean stop: its last summary stays until the TTL says it is silent
    worker.proc.wait(timeout=10)

    def silent() -> dict[str, Any] | None:
        report = run_power_watch(app, settings)
        mine = [f for f in report["findings"] if f["worker"] == worker.hostname]
        return mine[0] if mine else None

    finding = wait_for(silent, 20, "the killed worker to be found silent", 0.5)
    assert (finding["verdict"], finding["cause"]) == ("unresponsive", "worker_unresponsive")
    assert finding["numbers"]["summary_age_s"] >= 3
