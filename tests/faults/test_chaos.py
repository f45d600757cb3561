"""The chaos soak as a test: a seeded schedule of worker and engine kills, frozen engines,
Redis client kills, a Redis restart and S3 outages on a two-worker fleet; the run finishes
by itself, every prompt exactly once, no batch parked (see tests/faults/chaos.py)."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

from tests.faults.chaos import ACTIONS, fleet, schedule, soak_run

pytestmark = [pytest.mark.fault, pytest.mark.integration, pytest.mark.slow]

SEED = int(os.environ.get("GENFLEET_CHAOS_SEED", "4"))
# The soak's size: about 80 s of faults on a run that takes about 75 s without them.
PROMPTS, DURATION_S = 900, 80.0


def test_schedule_is_seeded_and_mixes_every_fault() -> None:
    plan = schedule(SEED, 90.0, 8.0)
    assert plan == schedule(SEED, 90.0, 8.0)
    assert [a for _, a in plan].count("restart_redis") == 1
    assert all(0 < at < 90 for at, _ in plan) and plan == sorted(plan)
    assert len({a for _, a in schedule(1, 600.0, 8.0)}) == 6


@pytest.mark.timeout(420)
def test_chaos_soak_finishes_exactly_once(tmp_path: Path) -> None:
    if shutil.which("redis-server") is None:
        pytest.skip("redis-server is not installed")
    with fleet(tmp_path) as soak:
        result = soak_run(soak, "chaos", PROMPTS, SEED, duration_s=DURATION_S, deadline_s=300.0)
    planned = [action for _, action in schedule(SEED, DURATION_S, 8.0)]
    assert result.actions == planned  # every fault was played before the run finished
    if SEED == 4:
        assert set(planned) == {*ACTIONS, "restart_redis"}
    print(
        f"\n[chaos seed {SEED}] {result.prompts} prompts in {result.seconds:.1f} s "
        f"({result.prompts_per_s:.2f}/s) through {len(result.actions)} faults: {result.actions}"
    )
