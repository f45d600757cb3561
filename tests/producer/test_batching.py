from __future__ import annotations

import pytest

from genfleet.common.records import PromptRecord
from genfleet.producer.batching import make_batches


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
