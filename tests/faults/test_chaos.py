"""The chaos soak as a test: a seeded schedule of worker and engine kills, frozen engines,
Redis client kills, a Redis restart and S3 outages on a two-worker fleet; the run finishes
by itself, every prompt exactly once, no batch parked (see harness/chaos.py)."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

from harness.chaos import ACTIONS, Played, fleet, schedule, soak_run
from harness.resends import Send, attribute

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


W1, W2 = "worker-a@chaos", "worker-b@chaos"


@pytest.mark.parametrize(
    ("sends", "faults", "charged"),
    [
        # A killed worker's prompts are sent again after the reaper took its batches: after a
        # blip that came between, and after the last fault, they are still the kill's.
        (
            [[Send(5.0, W1), Send(30.0, W2)]],
            [Played(10.0, "kill_worker", W1), Played(12.0, "broker_blip")],
            {"kill_worker": 1},
        ),
        # A fault on another worker explains nothing; one on the whole fleet does.
        (
            [[Send(5.0, W1), Send(30.0, W1)]],
            [Played(8.0, "kill_engine", W2), Played(9.0, "s3_outage")],
            {"s3_outage": 1},
        ),
        # The first fault on the earlier send's worker, whatever else came first.
        (
            [[Send(5.0, W1), Send(9.0, W1), Send(30.0, W2)]],
            [
                Played(6.0, "broker_blip"),
                Played(7.0, "stop_engine", W1),
                Played(20.0, "poison_prompt", W1),
            ],
            {"stop_engine": 1, "poison_prompt": 1},
        ),
        # Nothing broke between two sends: two copies of its batch ran at once.
        ([[Send(5.0, W1), Send(6.0, W2)]], [Played(1.0, "kill_worker", W1)], {"unexplained": 1}),
        # A producer killed while staging breaks no batch; one send is no resend.
        (
            [[Send(5.0, W1), Send(6.0, W2)], [Send(1.0, W1)]],
            [Played(5.5, "kill_producer")],
            {"unexplained": 1},
        ),
    ],
)
def test_each_resend_is_charged_to_the_fault_that_caused_it(
    sends: list[list[Send]], faults: list[Played], charged: dict[str, int]
) -> None:
    assert dict(attribute(sends, faults)) == charged
