"""What a run's answers are worth and the quality gate's decision (common/quality.py): pure."""

from __future__ import annotations

from typing import Any

import pytest

from genfleet.common.quality import (
    GateSettings,
    QualityTally,
    bucket,
    judge,
    marks,
    quality_text,
    shares,
    suggest_max_tokens,
)

GOOD = "a long enough answer that says something a trainer can use."


def answer(
    content: str | None = GOOD,
    reason: str = "stop",
    tokens: int = 300,
    reasoning_tokens: int = 0,
    error: bool = False,
    previous: str | None = None,
) -> dict[str, Any]:
    row: dict[str, Any] = {
        "content": content,
        "finish_reason": reason,
        "usage": {"completion_tokens": tokens, "reasoning_tokens": reasoning_tokens},
        "error": {"type": "x", "message": "y"} if error else None,
    }
    if previous is not None:
        row["previous"] = {"content": previous, "reasoning": None}
    return row


CUT_THINKING = answer("", "length", 64, 64)  # the reasoning used the whole budget


@pytest.mark.parametrize(
    ("row", "expected"),
    [
        (answer(), ["kept"]),
        (answer(""), ["empty", "short"]),
        (answer("OK."), ["short"]),
        (answer(GOOD, "length"), ["length"]),
        (CUT_THINKING, ["empty", "short", "length", "reasoning_full"]),
        (answer("", "length", 64, 0), ["empty", "short", "length"]),
        (answer(GOOD, "repetition"), ["stopped"]),
        (answer(None, error=True), ["error"]),
    ],
)
def test_each_answer_falls_in_its_kinds(row: dict[str, Any], expected: list[str]) -> None:
    assert marks(row) == expected


def tally_of(*groups: tuple[int, dict[str, Any]]) -> QualityTally:
    tally = QualityTally()
    for count, row in groups:
        for _ in range(count):
            tally.add(row)
    return tally


def test_shares_counters_round_trip_and_text() -> None:
    tally = tally_of((2, answer()), (23, CUT_THINKING), (2, answer(None, error=True)))
    found = shares(tally)
    assert found["kept"] == round(2 / 27, 4)
    assert found["length"] == found["reasoning_full"] == round(23 / 27, 4)
    assert found["bad"] == round(25 / 27, 4)
    again = QualityTally.from_counters({**tally.to_counters(), "errors": "9"})
    assert again == tally
    both = tally_of((2, answer()))
    both.merge(tally)
    assert both.answers == 29 and both.counts["kept"] == 4
    text = quality_text({"answers": 27, "shares": found})
    assert text.startswith("answers: 7.4% kept, 85.2% empty")
    assert "85.2% cut at max_tokens" in text and "7.4% errors" in text
    assert quality_text({"answers": 0}) == ""


@pytest.mark.parametrize(
    ("tokens", "edge"), [(0, 1), (1, 1), (2, 2), (3, 4), (64, 64), (65, 128), (2900, 4096)]
)
def test_buckets_round_up_to_a_power_of_two(tokens: int, edge: int) -> None:
    assert bucket(tokens) == edge


def test_the_suggestion_comes_from_what_finished_or_the_old_answers() -> None:
    assert suggest_max_tokens(tally_of((10, CUT_THINKING)), 64) == 128  # nothing finished
    finished = tally_of((10, CUT_THINKING), (19, answer(tokens=2900)), (1, answer(tokens=30)))
    assert suggest_max_tokens(finished, 64) == 4096
    old = tally_of((5, answer("", "length", 64, 64, previous="x" * 4 * 3000)))
    assert suggest_max_tokens(old, 64) == 4096


GATE = GateSettings(min_answers=50, bad_share=0.5)


@pytest.mark.parametrize(
    ("groups", "settings", "tripped", "says"),
    [
        # too few answers to judge, however bad
        ([(49, CUT_THINKING)], GATE, False, ""),
        # the reasoning used the whole budget: raise --max-tokens or turn thinking off
        ([(48, CUT_THINKING), (2, answer())], GATE, True, "reasoning used all 64 tokens"),
        # half bad is enough; a bit less is not
        ([(25, answer("OK.")), (25, answer())], GATE, True, "under 32 characters"),
        ([(24, answer("OK.")), (26, answer())], GATE, False, ""),
        # cut answers with content
        ([(40, answer(GOOD, "length", 64)), (20, answer())], GATE, True, "cut at max_tokens"),
        # errors
        ([(30, answer(None, error=True)), (20, answer())], GATE, True, "error records"),
        # stopped loops are not what the gate judges
        ([(40, answer(GOOD, "repetition")), (20, answer())], GATE, False, ""),
        # a healthy run: a few cut, a few short
        ([(3, answer(GOOD, "length")), (2, answer("")), (195, answer())], GATE, False, ""),
        # off
        ([(60, CUT_THINKING)], GateSettings(on=False), False, ""),
        # a regeneration whose new answers are much shorter than the old ones
        (
            [(60, answer(GOOD, previous="y" * 400))],
            GATE,
            True,
            "under 50% of the old answer's length",
        ),
        ([(60, answer(GOOD, previous=GOOD))], GATE, False, ""),
    ],
)
def test_the_gate_trips_on_mostly_bad_answers_only(
    groups: list[tuple[int, dict[str, Any]]], settings: GateSettings, tripped: bool, says: str
) -> None:
    verdict = judge(tally_of(*groups), settings, max_tokens=64, thinking=True)
    assert verdict.tripped is tripped
    assert says in verdict.reason
    if tripped and "reasoning" in says:
        # two answers finished, at 300 tokens: the p95 of those, a power of two
        assert verdict.suggested_max_tokens == 512
        assert verdict.fix == "raise --max-tokens to 512, or --no-thinking"


def test_a_regeneration_shorter_than_old_answers_longer_than_the_cap_raises_it() -> None:
    window = tally_of((60, answer(GOOD, previous="z" * 4 * 3000)))
    verdict = judge(window, GATE, max_tokens=1024, thinking=True)
    assert verdict.tripped and verdict.suggested_max_tokens == 4096
    assert verdict.fix == "the old answers' p95 is 4,096 tokens: raise --max-tokens to 4,096"


def test_the_fix_names_what_the_finished_answers_needed() -> None:
    window = tally_of((45, CUT_THINKING), (5, answer(tokens=2900)))
    verdict = judge(window, GATE, max_tokens=64, thinking=False)
    assert verdict.tripped
    assert "the answers that finished took up to 4,096 tokens (p95)" in verdict.reason
    assert verdict.fix == "raise --max-tokens to 4,096"
    assert verdict.message().endswith(": raise --max-tokens to 4,096")
