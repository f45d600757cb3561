"""Cutting a stream of prompts into batches: by count and by expected work, finer at the end.

A batch closes when it holds `batch_size` prompts or when the tokens it may generate
(the sum of each prompt's max_tokens) reach `batch_max_tokens`. The second rule bounds how long
a batch can run, which must stay well under the broker's visibility timeout.

The run's last `tail` batches' worth of prompts are cut again into batches that shrink
(each a `tail`-th of the prompts left, down to a sixteenth of `batch_size`): a worker whose
engine drains at the end of a run takes a small batch instead of the fleet waiting on one
worker's last full batch, so the fleet finishes together. This holds back `tail` batches
until the source ends or more prompts arrive, a bounded lookahead.

A `--regenerate` run knows roughly how long each answer will be: the old answer's length
(`hinted_tokens`). Its batches are also sized by that expected work: a batch closes when its
hinted work would pass `batch_size` prompts' worth at the mean hint so far, so a batch of
long-expected prompts holds fewer of them and no batch is the run's long pole. (The running
mean keeps the cut a pure function of the input.) The hints order work too: `enqueue` sends the
longest-expected batches first and a worker a batch's longest-expected prompts first.

Batch ids are the batch's index in input order and the cut is a pure function of the input and
these sizes, so the same input and settings always give the same batches (resume relies on it).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable, Iterator

from genfleet.common.previous import hint_tokens
from genfleet.common.records import PromptRecord

TAIL_MIN_FRACTION = 16  # the smallest tail batch holds batch_size // 16 prompts (at least 1)


def expected_tokens(record: PromptRecord, max_tokens: int) -> int:
    """The most this prompt can generate: its own max_tokens override or the run's."""
    if record.params:
        value = record.params.get("max_tokens")
        if isinstance(value, int) and value > 0:
            return value
    return max_tokens


def hinted_tokens(record: PromptRecord, max_tokens: int) -> int | None:
    """The work this prompt is expected to take: its old answer's length, at most its
    max_tokens; None without an old answer (no hint)."""
    hint = hint_tokens(record.previous)
    return None if hint is None else min(hint, expected_tokens(record, max_tokens))


class _HintedWork:
    """A batch's hinted work against `batch_size` prompts' worth at the mean hint so far."""

    def __init__(self, batch_size: int) -> None:
        self.batch_size = batch_size
        self.hints = self.total = 0  # hinted prompts seen, their hinted tokens
        self.work = 0  # of the batch being filled

    def cost(self, record: PromptRecord, max_tokens: int) -> int:
        """The prompt's hinted work; a prompt without a hint counts as the mean so far."""
        hint = hinted_tokens(record, max_tokens)
        if hint is None:
            return self.total // self.hints if self.hints else 0
        self.hints += 1
        self.total += hint
        return hint

    def full(self, cost: int) -> bool:
        return bool(self.hints) and self.work + cost > self.batch_size * self.total / self.hints


def _cut(
    records: Iterable[PromptRecord], batch_size: int, batch_max_tokens: int, max_tokens: int
) -> Iterator[list[PromptRecord]]:
    """Consecutive batches of at most `batch_size` prompts and `batch_max_tokens` of work (and,
    with hints, of at most `batch_size` prompts' worth of hinted work)."""
    batch: list[PromptRecord] = []
    work = 0
    hinted = _HintedWork(batch_size)
    for record in records:
        cost = expected_tokens(record, max_tokens)
        expected = hinted.cost(record, max_tokens)
        if batch and (
            len(batch) >= batch_size or work + cost > batch_max_tokens or hinted.full(expected)
        ):
            yield batch
            batch, work, hinted.work = [], 0, 0
        batch.append(record)
        work += cost
        hinted.work += expected
    if batch:
        yield batch


def tail_sizes(prompts: int, batch_size: int, tail: int) -> list[int]:
    """How many prompts each of the run's last batches may hold, for `prompts` left at the end.

    Each takes a `tail`-th of what is left (rounded up), at most `batch_size` and at least
    batch_size // 16, so the sizes shrink geometrically towards the end of the run.
    """
    sizes: list[int] = []
    left = prompts
    while left > 0:
        sizes.append(_tail_size(left, batch_size, tail))
        left -= sizes[-1]
    return sizes


def _tail_size(left: int, batch_size: int, tail: int) -> int:
    smallest = max(1, batch_size // TAIL_MIN_FRACTION)
    return min(left, batch_size, max(smallest, -(-left // max(1, tail))))


def make_batches(
    records: Iterable[PromptRecord],
    batch_size: int,
    batch_max_tokens: int,
    max_tokens: int,
    tail: int = 0,
) -> Iterator[list[PromptRecord]]:
    """Consecutive, non-empty batches covering `records` exactly once, in order; the last
    `tail` batches' worth of prompts in shrinking batches (`tail` 0: all batches full)."""
    if batch_size < 1 or batch_max_tokens < 1 or tail < 0:
        raise ValueError("batch_size and batch_max_tokens must be positive, tail not negative")
    full = _cut(records, batch_size, batch_max_tokens, max_tokens)
    if tail == 0:
        yield from full
        return
    window: deque[list[PromptRecord]] = deque()
    for batch in full:
        window.append(batch)
        if len(window) > tail:
            yield window.popleft()
    rest = [record for batch in window for record in batch]
    start = 0
    while start < len(rest):
        # The work rule still holds inside the tail: a size is a cap, never a minimum.
        size = _tail_size(len(rest) - start, batch_size, tail)
        batch = next(_cut(rest[start : start + size], size, batch_max_tokens, max_tokens))
        yield batch
        start += len(batch)
