"""`SeenIds`: duplicate ids told exactly, in bounded memory, whatever the hashes do.

Forced collisions (a digest of a few values) make every path run: a digest held by the
buffer, by a sorted level, by both, for ids that are and are not the same; small buffers make
levels form and merge. The answer must equal a plain set's, id for id.
"""

from __future__ import annotations

import random

import pytest

from genfleet.common.readers.seen import SeenIds


def reference(chunks: list[list[str]]) -> list[list[bool]]:
    seen: set[str] = set()
    answers = []
    for chunk in chunks:
        row = []
        for value in chunk:
            row.append(value in seen)
            seen.add(value)
        answers.append(row)
    return answers


@pytest.mark.parametrize(
    ("buckets", "buffer_size"),
    [(1, 2), (3, 4), (7, 16), (2**64, 8), (2**64, 1 << 16)],
)
def test_seen_ids_answer_as_a_set_does(buckets: int, buffer_size: int) -> None:
    rng = random.Random(buckets * 31 + buffer_size)
    pool = [f"id-{i}" for i in range(300)] + ["", "é", "\u2028", "a\nb"]
    chunks = [[rng.choice(pool) for _ in range(rng.randrange(1, 40))] for _ in range(60)]
    seen = SeenIds(buffer_size=buffer_size, digest=lambda s: hash(s) % buckets)
    try:
        assert [seen.check(chunk) for chunk in chunks] == reference(chunks)
    finally:
        seen.close()


def test_two_ids_with_one_digest_are_both_kept() -> None:
    seen = SeenIds(buffer_size=2, digest=len)  # "ab" and "cd" share a digest
    try:
        assert seen.check(["ab", "cd", "ab"]) == [False, False, True]
        assert seen.check(["xyz", "ef", "cd", "gh"]) == [False, False, True, False]
        assert seen.check(["ab", "zz", "xyz"]) == [True, False, True]  # from the levels
    finally:
        seen.close()
