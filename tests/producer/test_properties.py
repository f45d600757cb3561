"""Properties: batching and export cover every input exactly once, in input order."""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any

import orjson
from hypothesis import given, settings
from hypothesis import strategies as st

from genfleet.common import keys
from genfleet.common.manifest import BatchEntry, write_manifest
from genfleet.common.records import GenerationParams, PromptRecord, encode_jsonl_gz
from genfleet.common.settings import Settings
from genfleet.common.store import open_store
from genfleet.producer.batching import expected_tokens, make_batches
from genfleet.producer.export import export_run
from tests.support.stored_runs import STAGING_ID

RUN = "prop"
MAX_TOKENS = 100

ids = st.lists(st.text(min_size=1, max_size=8), min_size=1, max_size=40, unique=True)
overrides = st.one_of(st.none(), st.integers(min_value=1, max_value=400))


@st.composite
def prompt_lists(draw: st.DrawFn) -> list[PromptRecord]:
    """Unique ids, each expanded to its samples, some with their own max_tokens."""
    samples = draw(st.integers(min_value=1, max_value=3))
    records = []
    for record_id in draw(ids):
        override = draw(overrides)
        params = {"max_tokens": override} if override else None
        for sample in range(samples):
            records.append(
                PromptRecord(record_id, [{"role": "user", "content": "q"}], sample, params)
            )
    return records


@settings(max_examples=200, deadline=None)
@given(
    prompt_lists(), st.integers(min_value=1, max_value=10), st.integers(min_value=1, max_value=1000)
)
def test_batches_cover_every_prompt_once_in_order(
    records: list[PromptRecord], batch_size: int, batch_max_tokens: int
) -> None:
    batches = list(make_batches(records, batch_size, batch_max_tokens, MAX_TOKENS))
    assert [r.key for batch in batches for r in batch] == [r.key for r in records]
    for batch in batches:
        assert 1 <= len(batch) <= batch_size
        work = sum(expected_tokens(r, MAX_TOKENS) for r in batch)
        assert work <= batch_max_tokens or len(batch) == 1


def stage_and_finish(
    root: Path, records: list[PromptRecord], batch_size: int, missing: set[int], repeats: list[int]
) -> tuple[Settings, list[list[PromptRecord]], int]:
    """Stage `records` in batches and write outputs for all but the `missing` batch indexes.

    Each output object repeats some of its lines further on (a retried request, a merged
    checkpoint part); returns the settings, the batches and how many lines were extra.
    """
    settings_ = Settings(store=root.as_uri())
    store = open_store(settings_.store)
    batches = list(make_batches(records, batch_size, 10**9, MAX_TOKENS))
    entries = []
    extra = 0
    for index, batch in enumerate(batches):
        name = keys.batch_id(index)
        entries.append(BatchEntry(batch=name, key=keys.input_key(RUN, name), prompts=len(batch)))
        if index in missing:
            continue
        rows: list[dict[str, Any]] = [
            {"id": r.id, "sample": r.sample, "batch": name, "content": "a", "error": None}
            for r in batch
        ]
        for n, repeat in enumerate(repeats[: len(rows)]):
            if repeat:
                rows.append(dict(rows[n], content="again"))
                extra += 1
        store.put_if_absent(keys.output_key(RUN, name), encode_jsonl_gz(rows))
    write_manifest(
        store,
        RUN,
        STAGING_ID,
        entries,
        2,
        source="p",
        format="jsonl",
        fingerprint="f",
        created_at=0.0,
        params=GenerationParams(max_tokens=MAX_TOKENS, temperature=0.6, top_p=0.95, thinking=True),
        prompts_total=len(records),
        rejects=0,
    )
    return settings_, batches, extra


@settings(max_examples=60, deadline=None)
@given(
    prompt_lists(),
    st.integers(min_value=1, max_value=7),
    st.sets(st.integers(min_value=0, max_value=20)),
    st.lists(st.booleans(), max_size=7).map(lambda flags: [int(f) for f in flags]),
)
def test_export_covers_every_finished_input_once_in_order(
    records: list[PromptRecord], batch_size: int, missing: set[int], repeats: list[int]
) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        settings_, batches, extra = stage_and_finish(
            root / "store", records, batch_size, missing, repeats
        )
        out = root / "export.jsonl"
        result = export_run(settings_, RUN, str(out), "jsonl", partial=True)
        exported = [orjson.loads(line) for line in out.read_bytes().splitlines()]
        expected = [r.key for i, batch in enumerate(batches) if i not in missing for r in batch]
        assert [(row["id"], row["sample"]) for row in exported] == expected
        assert all(row["content"] == "a" for row in exported)  # the first copy wins
        assert result.records == len(expected) and result.duplicates == extra
        assert result.missing_batches == [
            keys.batch_id(i) for i in range(len(batches)) if i in missing
        ]
