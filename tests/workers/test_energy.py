"""Energy and cost per run: each batch's share of its GPUs' energy and time (a table), the
run's figures (a table), and a real worker on the emulator's simulated GPU whose run shows
kWh, J/token and cost per million tokens in `status` and `report`."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import orjson
import pytest
import redis

from genfleet.common.settings import Settings
from genfleet.common.store import open_store
from genfleet.producer.status import energy_figures, run_status
from genfleet.workers.observe.sampler import batch_share
from harness.env import base_env
from harness.processes import Worker
from harness.runs import stage_questions, wait_run_done
from harness.waits import wait_for
from tests.support.commands import genfleet

# name, (energy before, after), engine tokens, batch tokens, seconds, GPUs → (J, GPU-s)
SHARES = [
    ("alone on its engine", (1000.0, 4000.0), 500, 500, 10.0, 1, (3000.0, 10.0)),
    ("a third of the engine's tokens", (1000.0, 4000.0), 600, 200, 10.0, 1, (1000.0, 10 / 3)),
    ("tensor parallel: two GPUs' time", (0.0, 8000.0), 100, 100, 10.0, 2, (8000.0, 20.0)),
    ("no energy counter", (None, None), 100, 100, 10.0, 1, (None, 10.0)),
    ("counter reset mid-batch", (5000.0, 10.0), 100, 100, 10.0, 1, (None, 10.0)),
    ("all resumed from a checkpoint", (0.0, 50.0), 0, 0, 1.0, 1, (0.0, 0.0)),
    ("engine count lags the batch's", (0.0, 900.0), 50, 100, 9.0, 1, (900.0, 9.0)),
]


@pytest.mark.parametrize(
    ("energy", "engine", "batch", "seconds", "gpus", "expected"),
    [s[1:] for s in SHARES],
    ids=[s[0] for s in SHARES],
)
def test_batch_share(
    energy: tuple[float | None, float | None],
    engine: int,
    batch: int,
    seconds: float,
    gpus: int,
    expected: tuple[float | None, float],
) -> None:
    energy_j, gpu_s = batch_share(energy, engine, batch, seconds, gpus)
    assert gpu_s == pytest.approx(expected[1])
    assert energy_j == (None if expected[0] is None else pytest.approx(expected[0]))


def test_energy_figures() -> None:
    counters = {
        "energy_j": "7200000",
        "energy_batches": "4",
        "energy_batch_tokens": "2000000",
        "energy_tokens": "2000000",
        "gpu_s": "3600",
    }
    figures = energy_figures(counters, 2.5)
    assert figures["energy_kwh"] == pytest.approx(2.0)
    assert figures["j_per_token"] == pytest.approx(3.6)
    assert figures["gpu_hours"] == pytest.approx(1.0)
    assert figures["cost_per_million_tokens"] == pytest.approx(1.25)
    assert energy_figures(counters, None)["cost_per_million_tokens"] is None
    nothing = energy_figures({}, 2.5)
    assert (nothing["energy_kwh"], nothing["j_per_token"], nothing["gpu_hours"]) == (None,) * 3
    assert nothing["cost_per_million_tokens"] is None
    # energy measured on half the batches only: J/token over those batches' tokens
    half = energy_figures({**counters, "energy_batch_tokens": "1000000"}, None)
    assert half["j_per_token"] == pytest.approx(7.2)


@pytest.mark.integration
@pytest.mark.slow
def test_a_run_reports_its_energy_and_cost(
    tmp_path: Path,
    redis_url: str,
    redis_client: redis.Redis,
    start_worker: Callable[..., Worker],
) -> None:
    store = (tmp_path / "store").as_uri()
    env = base_env(redis_url, store, emulator_time_scale=20, sample_interval_s=0.2)
    worker = start_worker(env)
    settings = Settings(redis_url=redis_url, store=store, batch_size=50)
    stage_questions(settings, "watts", tmp_path, 200)
    worker.wait_ready()
    wait_run_done(settings, redis_client, "watts", 120)

    def settled() -> dict[str, Any] | None:
        # A batch's energy is added once it settled, just after its output was counted done.
        figures = run_status(open_store(store), redis_client, "watts", gpu_hour_cost=3.0)
        return figures if figures["energy_batches"] == figures["batches_total"] else None

    status = wait_for(settled, 10, "the last batch's energy", 0.1)
    assert status["energy_batches"] == status["batches_total"] == 4
    gpu_s = status["gpu_hours"] * 3600
    joules = status["energy_kwh"] * 3.6e6
    # the batches' energy over their GPU time is a mean power the simulated GPU can draw
    assert 80.0 * 0.9 <= joules / gpu_s <= 700.0
    assert status["j_per_token"] == pytest.approx(joules / status["completion_tokens"], rel=1e-3)
    cost = gpu_s / 3600 * 3.0 / (status["completion_tokens"] / 1e6)
    assert status["cost_per_million_tokens"] == pytest.approx(cost, rel=1e-3)

    def cli(*args: str) -> str:
        result = genfleet([*args, "--gpu-hour-cost", "3"], env, timeout_s=60)
        assert result.returncode == 0, result.stderr
        return " ".join(result.stdout.split())

    assert "kWh" in cli("status", "watts") and "USD per million tokens" in cli("status", "watts")
    report = orjson.loads(cli("report", "watts", "--json"))
    assert report["energy"]["cost_per_million_tokens"] == pytest.approx(cost, rel=1e-3)
    assert "J/token" in cli("report", "watts")
