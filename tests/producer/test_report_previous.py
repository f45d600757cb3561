"""`report`'s old answers against the new: the same short rule on both sides, lengths in
characters, error records on the old side only."""

from __future__ import annotations

from typing import Any

from genfleet.producer.report import PreviousAnswers, render_report


def record(
    content: str | None, previous: dict[str, Any] | None, error: bool = False
) -> dict[str, Any]:
    row: dict[str, Any] = {"content": content, "reasoning": "thought" if content else None}
    if previous is not None:
        row["previous"] = previous
    if error:
        row["error"] = {"type": "abort", "message": "x"}
    return row


def test_previous_and_new_side_by_side() -> None:
    answers = PreviousAnswers(short_chars=5)
    for row in (
        record("a long new answer", {"content": "OK.", "reasoning": None}),
        record("also long enough", {"content": "  ", "reasoning": None}),
        record("tiny", {"content": "a full old answer", "reasoning": "why"}),
        record(None, {"content": "OK.", "reasoning": None}, error=True),
        record("not regenerated", None),
    ):
        answers.add(row)
    data = answers.to_json()
    assert data is not None
    assert (data["count"], data["answered"]) == (4, 3)
    assert data["short_fraction"] == 0.75  # "OK.", "", "OK."
    assert data["empty_fraction"] == 0.25
    assert data["new_short_fraction"] == round(1 / 3, 4)  # "tiny"
    assert data["new_empty_fraction"] == 0.0
    assert data["short_replaced"] == 2
    assert data["content_chars"]["previous"] == {"mean": 5.75, "p50": 3, "p90": 17, "max": 17}
    assert data["content_chars"]["new"]["max"] == len("a long new answer")
    assert data["reasoning_chars"]["previous"]["max"] == 3
    assert data["with_reasoning_fraction"] == {"previous": 0.25, "new": 1.0}
    assert PreviousAnswers(32).to_json() is None  # a run without old answers: no comparison


def test_the_table_shows_previous_beside_new() -> None:
    answers = PreviousAnswers(short_chars=32)
    answers.add(record("x" * 40, {"content": "OK.", "reasoning": None}))
    stats = {"mean": 0.0, "p50": 0, "p90": 0, "max": 0}
    report = {
        "run": "r", "records": 1, "errors": 0, "batches_done": 1, "batches_total": 1,
        "length_capped": 0, "empty_answers": 0, "short_answers": 0, "short_chars": 32,
        "reasoning_without_content": 0, "duplicates": 0, "completion_tokens": stats,
        "reasoning_tokens": stats, "finish_reasons": {}, "errors_by_type": {}, "flags": [],
        "energy": None, "previous": answers.to_json(),
    }  # fmt: skip
    text = render_report(report)
    line = next(
        row
        for row in text.splitlines()
        if "short answers (< 32 chars)" in row and "%" in row and row.count("%") == 2
    )
    assert "100.0%" in line and "0.0%" in line
    assert "previous vs new (1 regenerated answers)" in text


def test_conversations_that_kept_older_assistant_turns_are_counted() -> None:
    answers = PreviousAnswers(short_chars=5)
    earlier = [
        {"role": "user", "content": "q1"},
        {"role": "assistant", "content": "a1"},
        {"role": "user", "content": "q2"},
    ]
    for messages, previous in (
        (earlier, {"content": "old a2", "reasoning": None}),  # multi-turn, last answer replaced
        ([{"role": "user", "content": "q"}], {"content": "old", "reasoning": None}),  # one turn
        (earlier, None),  # not regenerated: not counted
    ):
        row = record("a new answer", previous)
        row["messages"] = messages
        answers.add(row)
    data = answers.to_json()
    assert data is not None and (data["count"], data["with_earlier_answers"]) == (2, 1)
