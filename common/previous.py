"""The old answers of a regeneration (`--regenerate`): kept apart from what the engine sees,
copied to the output records, and read as length hints.

The reader takes a conversation's final assistant turn out of its messages and keeps it as the
record's `previous` (`{"content", "reasoning"}`); it is staged with the prompt. The worker
detaches it before any request is built (`detach`) and puts it back on the output record
(`attach`), so no byte of an old answer can reach the engine. Its length is the best guess of
how long the new answer will be (`hint_tokens`): batching sizes batches by it and a worker
sends a batch's longest-expected prompts first, so a run does not end on one long straggler.
"""

from __future__ import annotations

from genfleet.common.records import CompletionRecord, PromptRecord

Previous = dict[str, str | None]

CHARS_PER_TOKEN = 4  # the usual rule of thumb for English text under BPE tokenizers


def hint_tokens(previous: Previous | None) -> int | None:
    """The tokens an old answer took (content and reasoning, 4 characters a token), at least
    1; None without an old answer. A hint orders and sizes work, it never caps it."""
    if previous is None:
        return None
    chars = len(previous.get("content") or "") + len(previous.get("reasoning") or "")
    return max(1, -(-chars // CHARS_PER_TOKEN))


def detach(records: list[PromptRecord]) -> dict[int, Previous]:
    """Take the old answers off `records` (by index), so that what is sent holds none."""
    answers: dict[int, Previous] = {}
    for index, record in enumerate(records):
        if record.previous is not None:
            answers[index] = record.previous
            record.previous = None
    return answers


def attach(record: CompletionRecord, previous: Previous | None) -> CompletionRecord:
    """The output record with the old answer it replaces beside the new one."""
    record.previous = previous
    return record


def longest_first(indices: list[int], answers: dict[int, Previous]) -> list[int]:
    """`indices` with the longest-hinted first; stable, so without hints the order is kept."""
    return sorted(indices, key=lambda i: -(hint_tokens(answers.get(i)) or 0))
