"""The stall decision as a table, and the Prometheus counters it reads."""

from __future__ import annotations

import pytest

from genfleet.workers.engine.watchdog import StallClock, advance, parse_counters


@pytest.mark.parametrize(
    ("inflight", "before", "after", "stalled_s"),
    [
        (0, (5.0,), (5.0,), 0.0),  # idle is not stalled
        (3, (5.0,), (5.0,), 30.0),  # busy and nothing moved: the clock runs
        (3, (5.0,), (6.0,), 0.0),  # a completion came back
        (3, (5.0, 100.0), (5.0, 101.0), 0.0),  # the engine's token counter moved
        (3, (5.0, 100.0), (5.0, 100.0), 30.0),
    ],
)
def test_advance(
    inflight: int, before: tuple[float, ...], after: tuple[float, ...], stalled_s: float
) -> None:
    clock = advance(StallClock(0.0, before), 30.0, inflight, after)
    assert clock.stalled_s(30.0) == stalled_s


def test_advance_keeps_the_first_still_moment() -> None:
    clock = StallClock(0.0, (1.0,))
    for now in (10.0, 20.0, 30.0):
        clock = advance(clock, now, 2, (1.0,))
    assert clock.stalled_s(30.0) == 30.0


def test_parse_counters_sums_label_sets_and_skips_others() -> None:
    text = (
        "# TYPE sglang:generation_tokens_total counter\n"
        'sglang:generation_tokens_total{engine_type="unified",model_name="m"} 5.0\n'
        'sglang:generation_tokens_total{engine_type="unified",model_name="n"} 2.0\n'
        'sglang:generation_tokens_totalx{model_name="m"} 99.0\n'
        "sglang:realtime_tokens_total 7\n"
        'sglang:num_running_reqs{tp_rank="0"} 3.0\n'
    )
    assert parse_counters(text) == {
        "sglang:generation_tokens_total": 7.0,
        "sglang:realtime_tokens_total": 7.0,
    }
