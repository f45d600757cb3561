from __future__ import annotations

from pathlib import Path

import orjson
import pytest

from genfleet.common.errors import RunMismatch
from genfleet.common.readers import ReaderOptions
from genfleet.common.records import PromptRecord
from genfleet.common.settings import Settings
from genfleet.common.store import open_store
from genfleet.producer.batching import make_batches, tail_sizes
from genfleet.producer.enqueue import stage


def records(n: int, max_tokens: list[int | None] | None = None) -> list[PromptRecord]:
    out = []
    for i in range(n):
        override = max_tokens[i] if max_tokens else None
        params = {"max_tokens": override} if override else None
        out.append(PromptRecord(f"p{i}", [{"role": "user", "content": "x"}], params=params))
    return out


@pytest.mark.parametrize(
    ("n", "size", "work", "max_tokens", "expected"),
    [
        (0, 3, 10**9, 100, []),
        (1, 3, 10**9, 100, [1]),
        (7, 3, 10**9, 100, [3, 3, 1]),
        (6, 3, 10**9, 100, [3, 3]),
        # by expected work: 250 tokens of budget, 100 per prompt → 2 per batch
        (5, 100, 250, 100, [2, 2, 1]),
        # a single prompt above the budget still gets a batch of its own
        (2, 100, 50, 100, [1, 1]),
    ],
)
def test_batch_shapes(n: int, size: int, work: int, max_tokens: int, expected: list[int]) -> None:
    batches = list(make_batches(records(n), size, work, max_tokens))
    assert [len(b) for b in batches] == expected
    assert [r.id for b in batches for r in b] == [f"p{i}" for i in range(n)]


def test_per_prompt_max_tokens_counts_as_work() -> None:
    batches = list(make_batches(records(4, [1000, 10, 10, 1000]), 100, 1020, 100))
    assert [[r.id for r in b] for b in batches] == [["p0", "p1", "p2"], ["p3"]]


def test_bad_sizes() -> None:
    with pytest.raises(ValueError):
        list(make_batches(records(1), 0, 1, 1))


@pytest.mark.parametrize(
    ("prompts", "size", "tail", "expected"),
    [
        (0, 256, 4, []),
        (5, 256, 4, [5]),  # under the smallest tail batch: one batch
        (16, 256, 4, [16]),
        (300, 256, 4, [75, 57, 42, 32, 24, 18, 16, 16, 16, 4]),
        (1024, 256, 4, [256, 192, 144, 108, 81, 61, 46, 34, 26, 19, 16, 16, 16, 9]),
        (7, 3, 4, [2, 2, 1, 1, 1]),
        (10, 3, 1, [3, 3, 3, 1]),  # a tail of one batch: a tail-th of what is left is all of it
    ],
)
def test_tail_sizes(prompts: int, size: int, tail: int, expected: list[int]) -> None:
    sizes = tail_sizes(prompts, size, tail)
    assert sizes == expected
    assert sum(sizes) == prompts


@pytest.mark.parametrize(
    ("n", "size", "tail", "expected"),
    [
        (0, 3, 2, []),
        (7, 3, 0, [3, 3, 1]),  # tail 0: every batch full, as before
        # 20 prompts by 3: 6 full and one of 2; the last 2 batches' worth (3 + 2) cut finer
        (20, 3, 2, [3, 3, 3, 3, 3, 3, 1, 1]),
        (40, 8, 2, [8, 8, 8, 8, 4, 2, 1, 1]),
        (64, 16, 4, [16, 12, 9, 7, 5, 4, 3, 2, 2, 1, 1, 1, 1]),
    ],
)
def test_tail_batches_shrink(n: int, size: int, tail: int, expected: list[int]) -> None:
    batches = list(make_batches(records(n), size, 10**9, 100, tail))
    assert [len(b) for b in batches] == expected
    assert [r.id for b in batches for r in b] == [f"p{i}" for i in range(n)]
    # A pure function of the input and the sizes: the same cut every time (ids are indexes).
    again = list(make_batches(iter(records(n)), size, 10**9, 100, tail))
    assert [[r.id for r in b] for b in again] == [[r.id for r in b] for b in batches]


def test_tail_keeps_the_work_rule() -> None:
    """Inside the tail a batch still closes at batch_max_tokens; no prompt is dropped."""
    work = [100, 1000, 1000, 10, 10, 10, 1000, 10]
    batches = list(make_batches(records(8, work), 4, 1010, 100, 2))
    assert [r.id for b in batches for r in b] == [f"p{i}" for i in range(8)]
    for batch in batches:
        assert len(batch) <= 4
        assert sum(r.params["max_tokens"] for r in batch) <= 1010 or len(batch) == 1


def test_negative_tail() -> None:
    with pytest.raises(ValueError):
        list(make_batches(records(1), 1, 1, 1, -1))


def test_staging_with_a_tail_is_deterministic_and_named_in_the_identity(tmp_path: Path) -> None:
    """`stage` cuts the tail as make_batches does; staging again with the same settings
    (an interrupted run re-enqueued) gives the same batches, and a run staged with a tail
    refuses to be staged again without one."""
    source = tmp_path / "prompts.jsonl"
    source.write_bytes(
        b"".join(orjson.dumps({"id": f"p{i}", "prompt": f"q{i}"}) + b"\n" for i in range(40))
    )
    settings = Settings(store=(tmp_path / "store").as_uri(), batch_size=8, batch_tail=2)
    store = open_store(settings.store)
    manifest, staged = stage(settings, store, "r", str(source), ReaderOptions(), len, set())
    assert [b.prompts for b in manifest.entries(store)] == [8, 8, 8, 8, 4, 2, 1, 1]
    assert staged.batches_enqueued == 8 and manifest.staging["batch_tail"] == 2
    again, _ = stage(settings, store, "r", str(source), ReaderOptions(), len, set())
    assert again.fingerprint == manifest.fingerprint and again.shards == manifest.shards
    full = settings.model_copy(update={"batch_tail": 0})
    with pytest.raises(RunMismatch):
        stage(full, store, "r", str(source), ReaderOptions(), len, set())
