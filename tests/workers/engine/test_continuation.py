"""The continuation probe (`harness/continuation.py`): its comparison, and the emulator's
`/generate`, which goes on from prompt + drawn ids exactly as one uninterrupted draw."""

from __future__ import annotations

import asyncio
from typing import Any

import httpx
import pytest

from harness import continuation
from tests.support.emulator import StartEmulator


@pytest.mark.parametrize(
    ("a", "b", "expected"),
    [
        ([1, 2, 3], [1, 2, 3], None),
        ([1, 2, 3], [1, 9, 3], 1),
        ([7], [8], 0),
        ([1, 2], [1, 2, 3], 2),  # one stops short: it differs where it ends
        ([], [], None),
    ],
)
def test_where_two_answers_first_differ(a: list[int], b: list[int], expected: int | None) -> None:
    assert continuation.first_difference(a, b) == expected


def test_agreement_counts_from_the_cut() -> None:
    reference = [[1, 2, 3, 4], [1, 2, 3, 4], [1, 2, 3, 4], [5, 6, 7, 8]]
    drawn = [[1, 2, 3, 4], [1, 2, 9, 9], [1, 9, 3, 4], [5, 6, 7, 8]]
    figures = continuation.agreement(drawn, reference, cut=2)
    assert figures == {
        "answers": 4,
        "identical": 2,
        "first_difference_from_cut": [-1, 0],
        "at_the_cut": 1,
    }


@pytest.mark.integration
def test_the_emulator_goes_on_from_ids_as_one_draw(start_emulator: StartEmulator) -> None:
    engine = start_emulator()

    async def measure() -> dict[str, Any]:
        async with httpx.AsyncClient(base_url=engine.base_url, timeout=60) as client:
            probe = continuation.Engine(client, "test-model")
            return await continuation.probe(probe, continuation.texts(8), 96, 30)

    figures = asyncio.run(measure())
    for name in ("heads_vs_twin", "twins", "twins_other_batch", "continued_vs_twin"):
        assert figures[name]["identical"] == 8, figures
    assert figures["distinct_ids_p50"] > 20, figures  # the emulator draws text
