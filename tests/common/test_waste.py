"""Where the tokens went, as a table: each record's kind and the run's shares."""

from __future__ import annotations

from typing import Any

import pytest

from genfleet.common.waste import WasteTally, waste_kind, waste_text


def row(finish: str | None, content: str | None, tokens: int, **extra: Any) -> dict[str, Any]:
    usage = {"completion_tokens": tokens}
    return {"finish_reason": finish, "content": content, "usage": usage, "error": None, **extra}


LONG = "A full answer that a trainer will keep, well over the short limit."
STOPPED = row("repetition", "", 1500, repetition={"tokens_saved": 6692})


@pytest.mark.parametrize(
    ("record", "kind"),
    [
        (row("stop", LONG, 900), "kept"),
        (row("stop", "  ok  ", 20), "short"),
        (row("stop", "", 300), "short"),
        (row("length", LONG, 8192), "length"),
        (row("length", "", 8192), "length"),  # cut: the cap is the cause, not the content
        (STOPPED, "stopped"),
        ({**row(None, None, 0), "error": {"type": "abort", "message": "x"}}, "error"),
        ({**STOPPED, "error": {"type": "x", "message": "y"}}, "error"),
    ],
)
def test_each_record_has_one_kind(record: dict[str, Any], kind: str) -> None:
    assert waste_kind(record) == kind


def test_shares_energy_and_tokens_saved() -> None:
    tally = WasteTally()
    for record in (row("stop", LONG, 900), row("stop", "", 100), STOPPED, row("length", LONG, 500)):
        tally.add(record)
    figures = tally.figures(j_per_token=3.6e6 / 1000)  # 1 kWh per 1,000 tokens
    assert figures["generated_tokens"] == 3000
    assert figures["tokens_share"] == {
        "kept": 0.3, "short": 0.0333, "length": 0.1667, "stopped": 0.5, "error": 0.0,
    }  # fmt: skip
    assert figures["energy_kwh"]["stopped"] == pytest.approx(1.5)
    assert (figures["loops_stopped"], figures["tokens_saved"]) == (1, 6692)
    assert figures["tokens_saved_share"] == round(6692 / (3000 + 6692), 4)
    assert WasteTally.from_counters(tally.to_counters()).figures() == tally.figures()
    assert "stopped 50.0%" in waste_text(figures) and "6,692 tokens saved" in waste_text(figures)


def test_no_energy_without_a_counter_and_nothing_before_any_token() -> None:
    assert WasteTally().figures(None)["energy_kwh"] is None
    assert waste_text(WasteTally().figures()) == ""


def test_a_late_copy_counts_apart_from_the_records_shares() -> None:
    """A copy whose output another wrote first threw its tokens away: counted, shown, and
    kept out of the shares of what the records hold."""
    tally = WasteTally()
    tally.add(row("stop", LONG, 900))
    before = tally.figures()["tokens_share"]
    tally.merge(WasteTally.late_copy(4000))
    tally.merge(WasteTally.late_copy(0))  # it found the output before generating much
    figures = tally.figures()
    assert (figures["late_copies"], figures["late_copy_tokens"]) == (2, 4000)
    assert figures["tokens_share"] == before and figures["generated_tokens"] == 900
    assert WasteTally.from_counters(tally.to_counters()).figures() == figures
    assert "2 late copies of batches written by another copy threw away 4,000 tokens" in (
        waste_text(figures)
    )
