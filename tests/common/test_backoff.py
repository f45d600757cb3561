"""The one backoff rule and the numbers each of its users waits."""

from __future__ import annotations

import math
import re
from pathlib import Path

import pytest

from genfleet.common.backoff import (
    BATCH_RETRY,
    BOOKKEEPING,
    BUSY,
    OUTPUT_WRITE,
    PROMPT_RETRY,
    Backoff,
)
from harness.env import ROOT


@pytest.mark.parametrize(
    ("backoff", "delays"),
    [
        (PROMPT_RETRY, [0.5, 1.0, 2.0, 4.0, 8.0, 10.0, 10.0]),
        (BATCH_RETRY, [2.0, 4.0, 8.0, 16.0, 32.0, 60.0, 60.0]),
        (OUTPUT_WRITE, [2.0, 4.0, 8.0, 16.0, 30.0, 30.0, 30.0]),
        (BOOKKEEPING, [1.0, 2.0, 4.0, 8.0, 16.0, 32.0, 64.0]),
        (Backoff(base_s=2.0), [4.0, 8.0, 16.0, 32.0, 64.0, 128.0, 256.0]),
    ],
)
def test_delays_double_up_to_the_cap(backoff: Backoff, delays: list[float]) -> None:
    assert [backoff.delay_s(attempt) for attempt in range(1, 8)] == delays


def test_jitter_scales_within_its_band_and_a_huge_attempt_does_not_overflow() -> None:
    assert BUSY.delay_s(1, uniform=lambda low, high: low) == pytest.approx(0.4)
    assert BUSY.delay_s(1, uniform=lambda low, high: high) == pytest.approx(0.6)
    assert all(8.0 <= BUSY.delay_s(n) <= 12.0 for n in (6, 100, 5000))
    assert Backoff(base_s=1.0).delay_s(10_000) == 2.0**64 < math.inf
    assert Backoff(base_s=0.0).delay_s(3) == 0.0


def test_no_module_computes_a_backoff_of_its_own() -> None:
    """Every doubling wait goes through Backoff: `2 ** attempt` anywhere else is a second rule."""
    doubling = re.compile(r"\b2(\.0)?\s*\*\*\s*\(?\s*(min\()?[A-Za-z_]")
    hits = [
        f"{path.relative_to(ROOT)}:{number}: {line.strip()}"
        for top in ("common", "producer", "workers")
        for path in sorted((ROOT / top).rglob("*.py"))
        if path.relative_to(ROOT) != Path("common/backoff.py")
        for number, line in enumerate(path.read_text().splitlines(), 1)
        if doubling.search(line)
    ]
    assert hits == [], "use genfleet.common.backoff.Backoff:\n" + "\n".join(hits)
