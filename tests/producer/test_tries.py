"""A record's tries and the export rule, on runs written straight into a store: which records a
retry takes, which try stands, and that export and report read the same answers."""

from __future__ import annotations

import gzip
import time
from pathlib import Path
from typing import Any

import pyarrow.parquet as pq
import pytest

from genfleet.common import keys
from genfleet.common.errors import InputError
from genfleet.common.records import PromptRecord, encode_jsonl_gz
from genfleet.common.settings import Settings
from genfleet.common.store import Store, open_store
from genfleet.producer.export import export_run
from genfleet.producer.report import build_report
from genfleet.producer.runs.retries import retry_records, round_params, round_parent
from genfleet.producer.tries import (
    RetryMismatch,
    RetryRound,
    replaces,
    retry_kind,
    selected,
    write_round,
)
from tests.support.stored_runs import (
    STAGING_ID,
    completion,
    line_sha256s,
    read_jsonl,
    stage_prompts,
)

RUN = "tries"

ANSWER = {"finish_reason": "stop", "error": None}
ERROR = {"finish_reason": None, "content": None, "error": {"type": "timeout", "message": "t"}}
STOPPED = {"finish_reason": "repetition", "content": "ab" * 9, "error": None}
CUT = {"finish_reason": "length", "content": "long", "error": None}


@pytest.mark.parametrize(
    ("record", "kind"),
    [(ANSWER, None), (ERROR, "errors"), (STOPPED, "stopped"), (CUT, "cut")],
)
def test_retry_kind_names_the_flag_that_takes_a_record(
    record: dict[str, Any], kind: str | None
) -> None:
    assert retry_kind(record) == kind
    assert selected(record, {"errors", "stopped", "cut"}) is (kind is not None)
    assert not selected(record, {"errors", "stopped", "cut"} - {kind or ""}) or kind is None


@pytest.mark.parametrize(
    ("new", "old", "stands"),
    [
        (ANSWER, ERROR, True),
        (ANSWER, STOPPED, True),
        (CUT, STOPPED, True),  # the newest answer stands, cut or not
        (STOPPED, CUT, True),
        (ERROR, ANSWER, False),  # an error never replaces an answer
        (ERROR, CUT, False),
        (ERROR, ERROR, True),  # the newest error, when every try is one
    ],
)
def test_a_newer_try_stands_unless_it_is_an_error_over_an_answer(
    new: dict[str, Any], old: dict[str, Any], stands: bool
) -> None:
    assert replaces(new, old) is stands


@pytest.mark.parametrize(
    ("max_tokens", "guard", "changes"),
    [
        (None, True, {}),
        (4096, True, {"max_tokens": 4096}),
        (None, False, {"repetition_guard": False}),
        (64, False, {"max_tokens": 64, "repetition_guard": False}),
    ],
)
def test_a_round_records_only_the_parameters_it_changes(
    max_tokens: int | None, guard: bool, changes: dict[str, Any]
) -> None:
    assert round_params(max_tokens, guard) == changes


@pytest.fixture
def settings(tmp_path: Path) -> Settings:
    return Settings(store=(tmp_path / "store").as_uri())


@pytest.fixture
def store(settings: Settings) -> Store:
    return open_store(settings.store)


def kinded(prompt: PromptRecord, run: str, batch: str, kind: dict[str, Any]) -> dict[str, Any]:
    row = completion(prompt, run, batch)
    row.update(kind)
    if kind is ANSWER:  # a kept answer: 32 characters or more
        row["content"] = f"answer to {prompt.id}, long enough to keep"
    if prompt.previous is not None:  # the worker copies it from the staged prompt
        row["previous"] = prompt.previous
    if kind is STOPPED:
        row["repetition"] = {"block_chars": 2, "repeats": 9, "start_char": 0}
        row["reasoning"] = "thinking in a loop"
    return row


def write_outputs(
    store: Store, run: str, prompts: list[PromptRecord], kinds: dict[str, dict[str, Any]]
) -> None:
    """Each batch's output (one prompt per batch here), of the kind `kinds` gives its id."""
    for index, prompt in enumerate(prompts):
        batch = keys.batch_id(index)
        staged = store.get(keys.input_key(run, batch)) or b""
        digest = line_sha256s(gzip.decompress(staged))[0]
        row = {**kinded(prompt, run, batch, kinds.get(prompt.id, ANSWER)), "prompt_sha256": digest}
        assert store.put_if_absent(keys.output_key(run, batch), encode_jsonl_gz([row]))


def regenerated(n: int) -> list[PromptRecord]:
    return [
        PromptRecord(
            f"p{i}",
            [{"role": "user", "content": f"q{i}"}],
            previous={"content": f"old answer {i}", "reasoning": None},
        )
        for i in range(n)
    ]


def test_a_stopped_row_is_exported_without_its_loop_and_keeps_its_previous(
    settings: Settings, store: Store, tmp_path: Path
) -> None:
    prompts = regenerated(4)
    manifest = stage_prompts(store, RUN, prompts, batch_size=1)
    write_outputs(store, RUN, prompts, {"p1": STOPPED, "p2": CUT, "p3": ERROR})
    result = export_run(settings, RUN, str(tmp_path / "out.jsonl"))
    rows = {row["id"]: row for row in read_jsonl(tmp_path / "out.jsonl")}
    assert set(rows) == {"p0", "p1", "p2", "p3"}  # every prompt is a row
    assert rows["p1"]["content"] is None and rows["p1"]["reasoning"] is None
    assert rows["p1"]["repetition"]["repeats"] == 9 and rows["p1"]["finish_reason"] == "repetition"
    assert all(row["previous"]["content"] == f"old answer {row['id'][1]}" for row in rows.values())
    assert rows["p2"]["content"] == "long" and rows["p3"]["error"]["type"] == "timeout"
    counts = (result.records, result.cut, result.stopped, result.stopped_left_out, result.errors)
    assert counts == (4, 1, 1, 1, 1)
    kept = export_run(settings, RUN, str(tmp_path / "all.jsonl"), with_stopped=True)
    assert (kept.stopped, kept.stopped_left_out) == (1, 0)
    assert read_jsonl(tmp_path / "all.jsonl")[1]["content"] == STOPPED["content"]
    assert manifest.batches_total == 4


def add_round(
    store: Store,
    number: int,
    prompts: list[PromptRecord],
    kinds: dict[str, dict[str, Any]],
    staging: str = STAGING_ID,
) -> str:
    """A finished retry round of `prompts`, as `retry_records` and the workers leave it."""
    child = keys.retry_run(RUN, number)
    stage_prompts(store, child, prompts, batch_size=1)
    write_outputs(store, child, prompts, kinds)
    write_round(
        store,
        RetryRound(number, child, RUN, staging, ["errors"], {}, len(prompts), time.time()),
    )
    return child


def test_export_and_report_take_the_newest_accepted_try(
    settings: Settings, store: Store, tmp_path: Path
) -> None:
    prompts = regenerated(5)
    stage_prompts(store, RUN, prompts, batch_size=1)
    write_outputs(store, RUN, prompts, {"p1": ERROR, "p2": STOPPED, "p3": CUT, "p4": CUT})
    before = {k: store.get(k) for k in store.list(keys.outputs_prefix(RUN))}
    # round 1: p1 answered, p2 cut, p3 an error (the cut answer stands), p4 stopped
    add_round(store, 1, prompts[1:5], {"p2": CUT, "p3": ERROR, "p4": STOPPED})
    # round 2: p4 answered
    child = add_round(store, 2, prompts[4:5], {})
    result = export_run(settings, RUN, str(tmp_path / "out.parquet"), "parquet")
    export_run(settings, RUN, str(tmp_path / "out.jsonl"))
    rows = {row["id"]: row for row in read_jsonl(tmp_path / "out.jsonl")}
    assert [rows[i].get("try") for i in ("p0", "p1", "p2", "p3", "p4")] == [None, 1, 1, None, 2]
    assert rows["p4"]["tried_in"] == f"{child}/batch-000000" and rows["p4"]["run"] == RUN
    assert rows["p4"]["batch"] == "batch-000004" and rows["p4"]["content"].startswith(
        "answer to p4"
    )
    assert rows["p3"]["finish_reason"] == "length"  # the error did not replace it
    assert rows["p2"]["previous"]["content"] == "old answer 2"
    report = build_report(settings, RUN)
    assert (result.retried, result.retried_replaced, result.retried_kept) == (4, 3, 2)
    assert (report["retried"], report["retried_replaced"], report["retried_kept"]) == (4, 3, 2)
    assert (result.errors, result.cut, result.stopped) == (0, 2, 0)
    assert (report["errors"], report["length_capped"], report["stopped"]) == (0, 2, 0)
    tries = pq.read_table(tmp_path / "out.parquet").column("try").to_pylist()
    assert tries == [None, 1, 1, None, 2]
    assert {k: store.get(k) for k in store.list(keys.outputs_prefix(RUN))} == before


def test_a_round_of_another_staging_is_refused(
    settings: Settings, store: Store, tmp_path: Path
) -> None:
    prompts = regenerated(2)
    stage_prompts(store, RUN, prompts, batch_size=1)
    write_outputs(store, RUN, prompts, {"p1": ERROR})
    add_round(store, 1, prompts[1:], {}, staging="0ther0")
    with pytest.raises(RetryMismatch, match="staging"):
        export_run(settings, RUN, str(tmp_path / "out.jsonl"))
    assert not (tmp_path / "out.jsonl").exists()


def test_a_retry_answer_to_another_prompt_is_refused(
    settings: Settings, store: Store, tmp_path: Path
) -> None:
    prompts = regenerated(2)
    stage_prompts(store, RUN, prompts, batch_size=1)
    write_outputs(store, RUN, prompts, {"p1": ERROR})
    other = PromptRecord("p1", [{"role": "user", "content": "another question"}])
    add_round(store, 1, [other], {})
    with pytest.raises(RetryMismatch, match="another prompt"):
        build_report(settings, RUN)


def test_a_retry_round_is_not_retried_itself(settings: Settings, store: Store) -> None:
    prompts = regenerated(2)
    stage_prompts(store, RUN, prompts, batch_size=1)
    write_outputs(store, RUN, prompts, {"p1": ERROR})
    child = add_round(store, 1, prompts[1:], {"p1": ERROR})
    assert round_parent(store, child) == RUN and round_parent(store, RUN) is None
    with pytest.raises(InputError, match="retry round of"):
        retry_records(settings, child, {"errors"})
    assert not store.exists(keys.retry_round_key(child, 1))


def test_a_round_whose_run_is_gone_is_refused_not_skipped(
    settings: Settings, store: Store, tmp_path: Path
) -> None:
    prompts = regenerated(2)
    stage_prompts(store, RUN, prompts, batch_size=1)
    write_outputs(store, RUN, prompts, {"p1": ERROR})
    child = add_round(store, 1, prompts[1:], {})
    store.delete_prefix(f"{child}/")
    with pytest.raises(RetryMismatch, match="has no run"):
        export_run(settings, RUN, str(tmp_path / "out.jsonl"))
