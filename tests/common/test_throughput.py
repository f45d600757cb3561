"""tok/s over a window, for workers younger than the window (a table)."""

from __future__ import annotations

import pytest

from genfleet.common.throughput import spread

NOW = 1_000.0


@pytest.mark.parametrize(
    ("tokens", "since", "earliest", "rates"),
    [
        # a worker 30 s old: its 10-minute figure is its rate over those 30 s
        ({"w": 3000, "": 3000}, {"w": NOW - 30}, NOW - 28, {"w": 100.0, "": 100.0}),
        # older than the window: the whole window
        ({"w": 60000, "": 60000}, {"w": NOW - 5000}, NOW - 590, {"w": 100.0, "": 100.0}),
        # start unknown (a worker that stopped answering): the whole window
        ({"gone": 6000, "": 6000}, {}, NOW - 600, {"gone": 10.0, "": 10.0}),
        # the fleet starts at its oldest worker, or its oldest point if a gone one was older
        (
            {"a": 6000, "b": 3000, "": 9000},
            {"a": NOW - 60, "b": NOW - 30},
            NOW - 55,
            {"a": 100.0, "b": 100.0, "": 150.0},
        ),
        (
            {"a": 3000, "gone": 3000, "": 6000},
            {"a": NOW - 30},
            NOW - 120,
            {"a": 100.0, "gone": 5.0, "": 50.0},
        ),
        # a worker started a moment ago: at least one second, never a division by zero
        ({"w": 50, "": 50}, {"w": NOW}, NOW, {"w": 50.0, "": 50.0}),
    ],
)
def test_spread(
    tokens: dict[str, int], since: dict[str, float], earliest: float, rates: dict[str, float]
) -> None:
    assert spread(tokens, NOW, 600.0, since, earliest) == pytest.approx(rates)
