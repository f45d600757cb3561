"""The repetition guard: notice, while an answer streams, that its text has become a loop.

A thinking model sometimes falls into a loop, the same sentence or paragraph again and again
until `max_tokens`. The guard watches the tail of the text as it arrives and calls it a loop
when its last part is one block of `min_block_chars` … `max_block_chars` characters repeated
exactly, character for character: at least `min_span_chars` characters and `min_repeats`
copies of the block, or, for a block so long that those copies would run past
`max_span_chars`, that many characters and never fewer than three copies (a paragraph of
1,500 characters written out verbatim four times is a loop, and waiting for eight would let
it burn 3,000 tokens). It is conservative by construction: text that repeats a structure
with anything changing in it (a table's cells, a list's numbers, code's names, a refrain
between verses) is never periodic over thousands of characters; a run whose shortest period
is below `min_block_chars` (a rule of `=`, padding) is left alone.

Cost per chunk does not grow with the answer: the detector keeps only the tail it can need
(the span the longest block needs, plus slack), checks at most every
`check_every_chars`, and a check is a few C-level string searches and comparisons over that
tail. The candidate periods are the distances back to earlier copies of the last 32
characters (`str.rfind`); each is verified by comparing the tail with itself shifted by it.

    guard = RepetitionDetector(RepetitionRule())
    for delta in deltas:
        loop = guard.feed(delta)
        if loop is not None:   # stop the request: loop.start_char is where it began
            break
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from genfleet.common.settings import Settings

NEEDLE_CHARS = 32  # the tail's last characters whose earlier copies name candidate periods
MAX_CANDIDATES = 24  # candidate periods verified per check, nearest first
# A long block counts as a loop from this many verbatim copies on, when `min_repeats` of it
# would not fit `max_span_chars`: two copies are a quotation, three of a paragraph are not.
LONG_BLOCK_MIN_REPEATS = 3


@dataclass(frozen=True, slots=True)
class RepetitionRule:
    """When a tail counts as a loop: the settings `repetition_*`, with their defaults.

    The defaults stop a loop of a block of p characters once max(3,000, min(8 x p, 6,000),
    3 x p) characters of it have streamed (plus one check interval): within 2,000 tokens of
    its start for every block up to the longest (1,500 characters) at 4 characters a token.
    """

    min_span_chars: int = 3000
    min_repeats: int = 8
    min_block_chars: int = 10
    max_block_chars: int = 1500
    max_span_chars: int = 6000
    check_every_chars: int = 256

    def __post_init__(self) -> None:
        if not 1 <= self.min_block_chars <= self.max_block_chars:
            raise ValueError(
                f"repetition_min_block_chars ({self.min_block_chars}) must be between 1 and "
                f"repetition_max_block_chars ({self.max_block_chars})"
            )
        if self.min_repeats < 2 or self.min_span_chars < 1 or self.check_every_chars < 1:
            raise ValueError(
                "repetition_min_repeats must be at least 2, repetition_min_span_chars and "
                "the check interval at least 1"
            )
        if self.max_span_chars < self.min_span_chars:
            raise ValueError(
                f"repetition_max_span_chars ({self.max_span_chars}) must be at least "
                f"repetition_min_span_chars ({self.min_span_chars})"
            )

    def span_chars(self, block_chars: int) -> int:
        """How much periodic tail a block of this size needs before it counts as a loop."""
        copies = min(self.min_repeats, LONG_BLOCK_MIN_REPEATS)
        wanted = min(self.min_repeats * block_chars, self.max_span_chars)
        return max(self.min_span_chars, wanted, copies * block_chars)

    @property
    def keep_chars(self) -> int:
        """The tail a detector keeps: the longest span, room to find where it began, slack."""
        return self.span_chars(self.max_block_chars) + 2 * self.max_block_chars + 2 * NEEDLE_CHARS


def repetition_rule(settings: Settings) -> RepetitionRule | None:
    """The guard's rule from the `repetition_*` settings; None when `repetition_guard` is off."""
    if not settings.repetition_guard:
        return None
    return RepetitionRule(
        min_span_chars=settings.repetition_min_span_chars,
        min_repeats=settings.repetition_min_repeats,
        min_block_chars=settings.repetition_min_block_chars,
        max_block_chars=settings.repetition_max_block_chars,
        max_span_chars=settings.repetition_max_span_chars,
    )


@dataclass(frozen=True, slots=True)
class Loop:
    """A loop found: where it began (characters into the text fed), its block and copies."""

    start_char: int
    block_chars: int
    repeats: float
    chars: int  # the text fed so far, when it was found

    def to_json(self) -> dict[str, int | float]:
        return {
            "start_char": self.start_char,
            "block_chars": self.block_chars,
            "repeats": round(self.repeats, 1),
            "chars": self.chars,
        }


class RepetitionDetector:
    """One text stream's detector (an answer has two: reasoning and content)."""

    __slots__ = ("rule", "_tail", "_pending", "_seen", "_unchecked")

    def __init__(self, rule: RepetitionRule) -> None:
        self.rule = rule
        self._tail = ""
        self._pending: list[str] = []  # fed since the last check, joined to the tail then
        self._seen = 0  # characters fed, in all; the tail holds the last of them
        self._unchecked = 0

    @property
    def chars(self) -> int:
        """Characters fed so far."""
        return self._seen

    @property
    def tail_chars(self) -> int:
        """Characters kept: bounded by the rule, never by the length of the answer."""
        return len(self._tail) + self._unchecked

    def feed(self, delta: str) -> Loop | None:
        """Add the next piece of text; a Loop when the tail has become one."""
        if not delta:
            return None
        self._seen += len(delta)
        self._pending.append(delta)
        self._unchecked += len(delta)
        if self._unchecked < self.rule.check_every_chars:
            return None
        return self.check()

    def check(self) -> Loop | None:
        """Whether the tail, as it is now, ends in a loop (see the module docstring)."""
        if self._pending:  # one join per check, not a copy of the tail per chunk
            self._tail = "".join((self._tail, *self._pending))
            self._pending.clear()
            self._unchecked = 0
            keep = self.rule.keep_chars
            if len(self._tail) > 2 * keep:  # trimmed in halves: amortised O(1) a character
                self._tail = self._tail[-keep:]
        tail, rule = self._tail, self.rule
        n = len(tail)
        if n < rule.min_span_chars or n <= NEEDLE_CHARS:
            return None
        needle_at = n - NEEDLE_CHARS
        needle = tail[needle_at:]
        lowest = max(0, needle_at - rule.max_block_chars)
        end = n - 1  # excludes the needle itself
        for _ in range(MAX_CANDIDATES):
            found = tail.rfind(needle, lowest, end)
            if found < 0:
                return None
            period = needle_at - found
            end = found + NEEDLE_CHARS - 1
            span = rule.span_chars(max(period, rule.min_block_chars))
            if span > n:
                continue
            if tail[n - span : n - period] != tail[n - span + period :]:
                continue
            if period < rule.min_block_chars:
                return None  # a run of a short period (a rule of '=', padding): not a loop
            start = _run_start(tail, n - span, period)
            return Loop(
                start_char=self._seen - n + start,
                block_chars=period,
                repeats=(n - start) / period,
                chars=self._seen,
            )
        return None


def _run_start(tail: str, start: int, period: int) -> int:
    """The first index from which `tail` has `period`, given that it has it from `start`."""
    while start >= period and tail[start - period : start] == tail[start : start + period]:
        start -= period
    while start > 0 and tail[start - 1] == tail[start - 1 + period]:
        start -= 1
    return start
