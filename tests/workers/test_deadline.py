"""A request's deadline follows its token budget and the engine's measured per-sequence
pace: a pure function, table-tested, and the pace meter behind it."""

from __future__ import annotations

import pytest

from genfleet.workers.feeding.deadline import (
    DeadlinePolicy,
    SequencePace,
    max_tokens_of,
    request_deadline_s,
)


@pytest.mark.parametrize(
    ("max_tokens", "tokens_per_s", "base_s", "floor", "margin", "expected"),
    [
        (8192, 40.0, 600.0, 2.0, 2.0, 600 + 8192 / 40 * 2),
        # A 32K-token thinking completion at 10 tok/s per sequence: about two hours, not one.
        (32768, 10.0, 600.0, 2.0, 2.0, 600 + 32768 / 10 * 2),
        (1024, 10.0, 600.0, 2.0, 2.0, 600 + 1024 / 10 * 2),  # a short one: far less
        (8192, None, 600.0, 2.0, 2.0, 600 + 8192 / 2 * 2),  # nothing measured: the floor
        (8192, 0.5, 600.0, 2.0, 2.0, 600 + 8192 / 2 * 2),  # slower than the floor: the floor
        (8192, 40.0, 600.0, 2.0, 1.0, 600 + 8192 / 40),
        (0, 40.0, 30.0, 2.0, 2.0, 30.0),
    ],
)
def test_request_deadline(
    max_tokens: int,
    tokens_per_s: float | None,
    base_s: float,
    floor: float,
    margin: float,
    expected: float,
) -> None:
    got = request_deadline_s(
        max_tokens, tokens_per_s, base_s=base_s, min_tokens_per_s=floor, margin=margin
    )
    assert got == pytest.approx(expected)
    assert DeadlinePolicy(base_s, floor, margin).deadline_s(max_tokens, tokens_per_s) == got


def test_longer_budgets_get_longer_deadlines() -> None:
    policy = DeadlinePolicy(60.0, 2.0, 2.0)
    budgets = [256, 1024, 8192, 32768]
    deadlines = [policy.deadline_s(n, 20.0) for n in budgets]
    assert deadlines == sorted(deadlines) and len(set(deadlines)) == len(deadlines)


@pytest.mark.parametrize(
    ("params", "run_max_tokens", "expected"),
    [
        (None, 1024, 1024),
        ({}, 1024, 1024),
        ({"max_tokens": 32768}, 1024, 32768),
        ({"max_completion_tokens": 4096}, 1024, 4096),
        ({"max_tokens": True}, 1024, 1024),
        ({"max_tokens": "8"}, 1024, 1024),
    ],
)
def test_a_lines_own_max_tokens_sets_its_budget(
    params: dict[str, object] | None, run_max_tokens: int, expected: int
) -> None:
    assert max_tokens_of(params, run_max_tokens) == expected


def test_pace_is_the_slow_end_of_recent_completions_long_enough_to_measure() -> None:
    pace = SequencePace(size=10, min_tokens=32, quantile=0.1)
    assert pace.tokens_per_s() is None
    pace.add(8, 0.01)  # too short to measure decoding: ignored
    assert pace.tokens_per_s() is None
    for rate in (50, 40, 30, 20, 10, 60, 70, 80, 90, 100):
        pace.add(rate * 10, 10.0)
    assert pace.tokens_per_s() == pytest.approx(20.0)  # the 10th percentile of ten
    for _ in range(10):  # the window moves on: old samples leave it
        pace.add(1000, 10.0)
    assert pace.tokens_per_s() == pytest.approx(100.0)
