"""A store call's timeouts follow the deadline it must keep (a worker's: half its lease)."""

from __future__ import annotations

import pytest

from genfleet.common.store import call_timeouts


@pytest.mark.parametrize(
    ("deadline_s", "expected"),
    [
        (None, (5.0, 60.0, 3)),  # no deadline: a slow store is waited for
        (30.0, (2.5, 7.5, 1)),  # the default lease (60 s) halved
        (600.0, (5.0, 60.0, 1)),
        (2.0, (0.5, 1.0, 1)),  # a test's short lease: floors, never zero
    ],
)
def test_call_timeouts(deadline_s: float | None, expected: tuple[float, float, int]) -> None:
    assert call_timeouts(deadline_s) == expected


@pytest.mark.parametrize("deadline_s", [10.0, 30.0, 120.0, 600.0])
def test_one_try_fits_a_third_of_the_deadline(deadline_s: float) -> None:
    connect_s, read_s, attempts = call_timeouts(deadline_s)
    assert attempts == 1 and connect_s + read_s <= deadline_s / 3 + 1e-9
