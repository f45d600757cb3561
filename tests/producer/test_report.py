"""The quality report: counts, exact percentiles, flags, and the text rendering."""

from __future__ import annotations

import math
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from genfleet.common import keys
from genfleet.common.manifest import BatchEntry, write_manifest
from genfleet.common.records import GenerationParams, encode_jsonl_gz
from genfleet.common.settings import Settings
from genfleet.common.store import open_store
from genfleet.producer.report import build_report, distribution, render_report
from tests.support.stored_runs import STAGING_ID

RUN = "report-run"


def record(
    i: int, content: str | None = "a perfectly reasonable answer, long enough", **extra: Any
) -> dict[str, Any]:
    data: dict[str, Any] = {
        "id": f"r{i}",
        "run": RUN,
        "sample": 0,
        "reasoning": "some thoughts",
        "content": content,
        "finish_reason": "stop",
        "usage": {"prompt_tokens": 5, "completion_tokens": 100, "reasoning_tokens": 40},
        "error": None,
    }
    data.update(extra)
    return data


def write_run(tmp_path: Path, batches: list[list[dict[str, Any]] | None]) -> Settings:
    """A run whose i-th batch has these output records (None: no output object yet)."""
    settings = Settings(store=(tmp_path / "store").as_uri())
    store = open_store(settings.store)
    entries = []
    for index, rows in enumerate(batches):
        batch = keys.batch_id(index)
        entries.append(
            BatchEntry(batch=batch, key=keys.input_key(RUN, batch), prompts=len(rows or []))
        )
        if rows is not None:
            store.put_if_absent(keys.output_key(RUN, batch), encode_jsonl_gz(rows))
    write_manifest(
        store,
        RUN,
        STAGING_ID,
        entries,
        2,
        source="t",
        format="jsonl",
        fingerprint="f",
        created_at=0.0,
        params=GenerationParams(max_tokens=100, temperature=0.6, top_p=0.95, thinking=True),
        prompts_total=sum(len(rows or []) for rows in batches),
        rejects=0,
    )
    return settings


def test_counts_and_flags_of_a_run_of_short_answers(tmp_path: Path) -> None:
    rows = [
        record(0),
        record(1, content=""),
        record(2, content=None),  # reasoning but no content
        record(
            3,
            content="ok",
            finish_reason="length",
            usage={"completion_tokens": 100, "reasoning_tokens": 99},
        ),
        record(4, content="Yes."),
        record(
            5,
            content=None,
            reasoning=None,
            finish_reason=None,
            error={"type": "context_length", "message": "x"},
        ),
        record(
            6,
            content=None,
            reasoning=None,
            finish_reason=None,
            error={"type": "timeout", "message": "y"},
        ),
        record(
            7,
            content=None,
            reasoning=None,
            finish_reason=None,
            error={"type": "timeout", "message": "z"},
        ),
    ]
    duplicate = record(0)  # the same (id, sample) twice in one output object: dropped
    settings = write_run(tmp_path, [[*rows[:4], duplicate], rows[4:]])
    report = build_report(settings, RUN, short_chars=10, threshold=0.2)
    assert report["records"] == 8 and report["duplicates"] == 1
    assert report["errors"] == 3
    assert report["errors_by_type"] == {"timeout": 2, "context_length": 1}
    assert report["finish_reasons"] == {"stop": 4, "length": 1}
    assert report["length_capped"] == 1
    assert report["empty_answers"] == 2
    assert report["short_answers"] == 4  # "", None, "ok", "Yes."
    assert report["reasoning_without_content"] == 2
    assert report["completion_tokens"] == {"mean": 100.0, "p50": 100, "p90": 100, "max": 100}
    assert report["reasoning_tokens"]["max"] == 99
    assert report["flags"] == [
        "short_or_empty_answers 80.0% > 20%",
        "reasoning_without_content 40.0% > 20%",
        "errors 37.5% > 20%",
    ]


def test_short_by_tokens(tmp_path: Path) -> None:
    rows = [
        record(0, usage={"completion_tokens": 50, "reasoning_tokens": 48}),  # 2 content tokens
        record(1, usage={"completion_tokens": 50, "reasoning_tokens": 10}),
    ]
    settings = write_run(tmp_path, [rows])
    assert build_report(settings, RUN, short_chars=1)["short_answers"] == 0
    assert build_report(settings, RUN, short_chars=1, short_tokens=5)["short_answers"] == 1


def test_healthy_run_has_no_flags_and_renders(tmp_path: Path) -> None:
    rows = [
        record(i, usage={"completion_tokens": i + 1, "reasoning_tokens": 0}) for i in range(100)
    ]
    settings = write_run(tmp_path, [rows[:50], rows[50:]])
    report = build_report(settings, RUN)
    assert report["flags"] == []
    assert report["completion_tokens"] == {"mean": 50.5, "p50": 50, "p90": 90, "max": 100}
    text = render_report(report)
    for expected in ("records", "100", "completion_tokens", "50.5", "finish: stop", "flags: none"):
        assert expected in text


def test_unfinished_run_is_reported_and_flagged(tmp_path: Path) -> None:
    settings = write_run(tmp_path, [[record(0)], None, None])
    report = build_report(settings, RUN)
    assert (report["batches_done"], report["batches_missing"], report["records"]) == (1, 2, 1)
    assert "incomplete: 2 of 3 batches have no output" in report["flags"]
    assert "incomplete" in render_report(report)


def test_empty_run(tmp_path: Path) -> None:
    report = build_report(write_run(tmp_path, [None]), RUN)
    assert report["records"] == 0
    assert report["completion_tokens"] == {"mean": 0.0, "p50": 0, "p90": 0, "max": 0}
    assert "no records" in report["flags"]


@given(st.lists(st.integers(min_value=0, max_value=5000), min_size=1, max_size=300))
def test_distribution_is_exact_nearest_rank(values: list[int]) -> None:
    ordered = sorted(values)
    stats = distribution(Counter(values))
    for name, share in (("p50", 0.5), ("p90", 0.9)):
        assert stats[name] == ordered[max(1, math.ceil(share * len(values))) - 1]
    assert stats["max"] == ordered[-1]
    assert stats["mean"] == pytest.approx(sum(values) / len(values), abs=0.01)
