"""The chaos soak as a test: a seeded schedule of worker and engine kills, frozen engines,
Redis client kills, a Redis restart and S3 outages on a two-worker fleet, placed per 1,000
prompts completed; the run finishes by itself, every prompt exactly once, no batch parked (see
harness/chaos.py). And the tables of what the soak charges to each fault: prompts sent again
(harness/resends.py) and generated tokens redone (harness/redone.py)."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

from harness.chaos import ACTIONS, LAST_SHARE, Played, fleet, schedule, soak_run
from harness.redone import redone_tokens
from harness.resends import Send, attribute

pytestmark = [pytest.mark.fault, pytest.mark.integration, pytest.mark.slow]

SEED = int(os.environ.get("GENFLEET_CHAOS_SEED", "4"))
# The soak's size: 900 prompts at 10 faults per 1,000 (seed 4: the 10 faults the schedule in
# seconds played before answers went on from their ids made the run end before its last
# fault, in the same order: every kind); `bench/chaos.py --quick` runs 1,800 prompts at 7 per
# 1,000 for its figures.
PROMPTS, PER_1000 = 900, 10.0


def test_schedule_is_seeded_per_prompts_and_mixes_every_fault() -> None:
    plan = schedule(SEED, PROMPTS, PER_1000)
    assert plan == schedule(SEED, PROMPTS, PER_1000)
    assert [a for _, a in plan].count("restart_redis") == 1
    assert all(0 < at < LAST_SHARE * PROMPTS for at, _ in plan) and plan == sorted(plan)
    assert len({a for _, a in schedule(1, 10_000, PER_1000)}) == 6
    # A rate per unit of work: twice the run, twice the faults (within the draw's spread).
    assert 1.6 < len(schedule(SEED, 20_000, 7.0)) / len(schedule(SEED, 10_000, 7.0)) < 2.4
    assert 55 <= len(schedule(SEED, 10_000, 7.0)) <= 85


@pytest.mark.timeout(420)
def test_chaos_soak_finishes_exactly_once(tmp_path: Path) -> None:
    if shutil.which("redis-server") is None:
        pytest.skip("redis-server is not installed")
    with fleet(tmp_path) as soak:
        result = soak_run(soak, "chaos", PROMPTS, SEED, deadline_s=300.0, per_1000=PER_1000)
    planned = [action for _, action in schedule(SEED, PROMPTS, PER_1000)]
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


KILL_W1 = Played(10.0, "kill_worker", W1, started=W2)


@pytest.mark.parametrize(
    ("tries", "ended", "generated", "faults", "redone", "kept"),
    [
        # One try, ended: nothing redone.
        ([[Send(1.0, W1, 7, "a", 0)]], {"a": 90}, {(W1, 7): 90}, [], {}, 90),
        # A lost worker: its engine died with the try (no end line) after 55 tokens; the next
        # try went on from the 40 its checkpoint held: 15 redone, charged to the kill.
        (
            [[Send(1.0, W1, 7, "a", 0), Send(12.0, W2, 8, "b", 40)]],
            {"b": 60},
            {(W1, 7): 55, (W2, 8): 60},
            [KILL_W1],
            {"kill_worker": 15},
            100,
        ),
        # An engine frozen, then its worker killed before the watchdog's kill: the kill took
        # the ids the worker held, so what was redone is the kill's (a resend is the freeze's).
        (
            [[Send(1.0, W1, 7, "a", 0), Send(12.0, W2, 8, "b", 40)]],
            {"b": 60},
            {(W1, 7): 55, (W2, 8): 60},
            [Played(9.0, "stop_engine", W1), KILL_W1],
            {"kill_worker": 15},
            100,
        ),
        # An answer that started over: all the first try drew is redone.
        (
            [[Send(1.0, W1, 7, "a", 0), Send(12.0, W1, 9, "b", 0)]],
            {"a": 30, "b": 80},
            {(W1, 7): 30, (W1, 9): 80},
            [Played(5.0, "stop_engine", W1)],
            {"stop_engine": 30},
            80,
        ),
        # A checkpoint older than the try's start: the try keeps nothing, and the one before
        # it loses what came after the checkpoint (60 of 100, then 80 of 80 with 50 carried).
        (
            [
                [
                    Send(1.0, W1, 7, "a", 0),
                    Send(5.0, W1, 8, "b", 100),
                    Send(12.0, W2, 9, "c", 40),
                ]
            ],
            {"a": 100, "c": 200},
            {(W1, 7): 100, (W1, 8): 30, (W2, 9): 200},
            [Played(3.0, "kill_engine", W1), KILL_W1],
            {"kill_engine": 60, "kill_worker": 30},
            240,
        ),
        # Two tries of one engine process died with it: they share its lost tokens by cause.
        (
            [
                [Send(1.0, W1, 7, "a", 0), Send(12.0, W2, 8, "b", 10)],
                [Send(2.0, W1, 7, "c", 0), Send(13.0, W2, 8, "d", 20)],
            ],
            {"b": 40, "d": 50},
            {(W1, 7): 70, (W2, 8): 90},
            [KILL_W1],
            {"kill_worker": 40},
            120,
        ),
        # Two copies of a batch at once: the one not kept is redone, explained by nothing.
        (
            [[Send(1.0, W1, 7, "a", 0), Send(2.0, W2, 8, "b", 0)]],
            {"a": 50, "b": 50},
            {(W1, 7): 50, (W2, 8): 50},
            [],
            {"unexplained": 50},
            50,
        ),
    ],
)
def test_tokens_redone_are_what_no_kept_answer_holds_charged_to_the_fault_that_cut_them(
    tries: list[list[Send]],
    ended: dict[str, int],
    generated: dict[tuple[str, int], int],
    faults: list[Played],
    redone: dict[str, int],
    kept: int,
) -> None:
    result = redone_tokens(tries, ended, generated, faults)
    assert dict(result.by_cause) == redone
    assert result.kept == kept
    assert result.inconsistent == 0
    assert sum(generated.values()) - result.total == kept  # every token kept or redone


def test_an_engine_process_with_tries_and_no_tokens_count_is_refused() -> None:
    with pytest.raises(ValueError, match="no tokens file"):
        redone_tokens([[Send(1.0, W1, 7, "a", 0)]], {}, {}, [])
