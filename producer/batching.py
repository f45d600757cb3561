"""Cutting a stream of prompts into batches: by count and by expected work.

A batch closes when it holds `batch_size` prompts or when the tokens it may generate
(the sum of each prompt's max_tokens) reach `batch_max_tokens`. The second rule bounds how long
a batch can run, which must stay well under the broker's visibility timeout. Batch ids are the
batch's index in input order, so the same input and sizes always give the same batches.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

from genfleet.common.records import PromptRecord


def expected_tokens(record: PromptRecord, max_tokens: int) -> int:
    """The most this prompt can generate: its own max_tokens override or the run's."""
    if record.params:
        value = record.params.get("max_tokens")
        if isinstance(value, int) and value > 0:
            return value
    return max_tokens


def make_batches(
    records: Iterable[PromptRecord], batch_size: int, batch_max_tokens: int, max_tokens: int
) -> Iterator[list[PromptRecord]]:
    """Consecutive, non-empty batches covering `records` exactly once, in order."""
    if batch_size < 1 or batch_max_tokens < 1:
        raise ValueError("batch_size and batch_max_tokens must be positive")
    batch: list[PromptRecord] = []
    work = 0
    for record in records:
        cost = expected_tokens(record, max_tokens)
        if batch and (len(batch) >= batch_size or work + cost > batch_max_tokens):
            yield batch
            batch, work = [], 0
        batch.append(record)
        work += cost
    if batch:
        yield batch
