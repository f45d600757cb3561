"""The repetition guard: notice, while an answer streams, that its text has become a loop.

A model sometimes falls into a loop: the same paragraph, sentence, word or character again
and again until `max_tokens`. The guard watches the tail of the text as it arrives and calls
it a loop when its last part is one block repeated exactly, character for character:

- a block of `min_block_chars` … `max_block_chars` characters: at least `min_span_chars` of
  the tail and `min_repeats` copies of the block, or, for a block so long that those copies
  would run past `max_span_chars`, that many characters and never fewer than three copies (a
  paragraph of 1,500 characters written out verbatim four times is a loop; waiting for eight
  would let it burn 3,000 tokens);
- a block shorter than `min_block_chars` (a degenerate loop: `"\\n"`, `" the"`, `"ha "`, a
  backslash): `short_span_chars` of the tail. A rule of `=` or a row of dashes is far
  shorter than that; a thousand characters of one short block is never text.

Spans count a character outside ASCII as four (a token's worth, as a CJK character is): a
loop of Chinese text is stopped after as many tokens as one of English text.

What is not a loop:

- **Progress.** Only exact repetition counts, so text whose repeated structure carries
  anything that changes (a table's numbers, a list's counter, code's names, a song's verses
  between its refrains, `99 bottles … 98 bottles`) never is one.
- **What the prompt asks for.** A prompt that asks for repetition ("150 times", "400 cells",
  "a 60x60 grid", "4,000 digits", "300 rows", "repeat … over and over") allows it: up to
  twice the largest count it names, and without limit when it names none. A model that
  overshoots the count it was given is looping again and is stopped.
- **What the prompt holds.** Where the prompt names no count, a block whose every line
  (digits, case and whitespace aside) appears in the prompt, or, for a short block, a run of
  it, is the prompt's own text: copying it out is never stopped.

Which texts are loops and which are not is measured on a labelled corpus of real texts
(`tests/data/repetition/`, `bench/waste.py`).

Cost per chunk does not grow with the answer: the detector keeps only the tail it can need
(the span the longest block needs, plus slack), checks at most every `check_every_chars`, and
a check is a few C-level string searches and comparisons over that tail. The candidate
periods are the distances back to earlier copies of the last 32 characters (`str.rfind`);
each is verified by comparing the tail with itself shifted by it. The prompt is read (a few
regular expressions) only when a loop is found, once per loop.

    guard = RepetitionDetector(RepetitionRule(), prompt=prompt_text(messages))
    for delta in deltas:
        loop = guard.feed(delta)
        if loop is not None:   # stop the request: loop.start_char is where it began
            break
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from genfleet.common.settings import Settings

NEEDLE_CHARS = 32  # the tail's last characters whose earlier copies name candidate periods
MAX_CANDIDATES = 24  # candidate periods verified per check, nearest first
# A long block counts as a loop from this many verbatim copies on, when `min_repeats` of it
# would not fit `max_span_chars`: two copies are a quotation, three of a paragraph are not.
LONG_BLOCK_MIN_REPEATS = 3
WIDE_CHAR_WEIGHT = 4  # a character outside ASCII counts as this many (about a token)
EVIDENCE_CHARS = 120  # the block's first characters kept in the record
ASKED_FACTOR = 2  # a prompt that names a count allows this many times as many copies


@dataclass(frozen=True, slots=True)
class RepetitionRule:
    """When a tail counts as a loop: the settings `repetition_*`, with their defaults.

    The defaults stop a loop of a block of p characters once max(3,000, min(8 x p, 6,000),
    3 x p) characters of it have streamed (plus one check interval), and a loop of a block
    under 10 characters once 1,000 have: within 2,000 tokens of its start for every block up
    to the longest (1,500 characters) at 4 characters a token, and for a one-character block
    even at a token a character.
    """

    min_span_chars: int = 3000
    min_repeats: int = 8
    min_block_chars: int = 10
    max_block_chars: int = 1500
    max_span_chars: int = 6000
    short_span_chars: int = 1000
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
        if self.short_span_chars < 2 * NEEDLE_CHARS:
            raise ValueError(
                f"repetition_short_span_chars ({self.short_span_chars}) must be at least "
                f"{2 * NEEDLE_CHARS}"
            )

    def span_chars(self, block_chars: int) -> int:
        """How much periodic tail a block of this size needs before it counts as a loop (in
        weighted characters, `weighted_chars`, as the block's size is for a long block)."""
        if block_chars < self.min_block_chars:
            return max(self.short_span_chars, 2 * block_chars)
        copies = min(self.min_repeats, LONG_BLOCK_MIN_REPEATS)
        wanted = min(self.min_repeats * block_chars, self.max_span_chars)
        return max(self.min_span_chars, wanted, copies * block_chars)

    @property
    def keep_chars(self) -> int:
        """The tail a detector keeps: the longest span, room to find where it began, slack."""
        longest = max(self.span_chars(self.max_block_chars), self.short_span_chars)
        return longest + 2 * self.max_block_chars + 2 * NEEDLE_CHARS


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
        short_span_chars=settings.repetition_short_span_chars,
    )


def weighted_chars(text: str) -> int:
    """Characters, one outside ASCII counting WIDE_CHAR_WEIGHT: about 4 x the tokens."""
    if text.isascii():
        return len(text)
    wide = len(text) - len(text.encode("ascii", "ignore"))
    return len(text) + (WIDE_CHAR_WEIGHT - 1) * wide


def token_estimate(text: str) -> float:
    """Tokens of a text, estimated: 4 ASCII characters, or one other character, a token."""
    return weighted_chars(text) / 4


@dataclass(frozen=True, slots=True)
class Loop:
    """A loop found: where it began (characters into the text fed), its block and copies.

    `block_chars` is the period; `block` the block's first characters as the model first
    wrote them (the evidence); `rule` which rule stopped it (`block` or `short`)."""

    start_char: int
    block_chars: int
    repeats: float
    chars: int  # the text fed so far, when it was found
    block: str = ""
    rule: str = "block"

    def to_json(self) -> dict[str, Any]:
        return {
            "start_char": self.start_char,
            "block_chars": self.block_chars,
            "repeats": round(self.repeats, 1),
            "chars": self.chars,
            "block": self.block,
            "rule": self.rule,
        }


# --- what the prompt allows ----------------------------------------------------------------

_UNITS = (
    r"times|x|copies|rows?|lines?|columns?|cells?|digits?|decimal places|places|entries|"
    r"items|elements|records|statements|inserts|values|bytes|words|characters|chars|zeros|"
    r"zeroes|ones|repetitions|iterations|verses"
)
_COUNT = r"(\d{1,3}(?:,\d{3})+|\d+)"
# "150 times", "400 empty cells", "4,000 digits", "4096 zero bytes", "a 300-row table"; not
# "7 times 8" (a product)
_COUNTED = re.compile(rf"\b{_COUNT}(?:\s+|-)(?:[a-z]+[\s-]+)?(?:{_UNITS})\b(?!\s*\d)")
_GRID = re.compile(r"\b(\d+)\s*[x×*]\s*(\d+)\b")  # a 60x60 grid
_UNBOUNDED = re.compile(
    r"\bover and over\b|\bagain and again\b|\brepeat\w*\b[^.?!\n]{0,80}\b(?:forever|endlessly)\b"
    r"|重复"
)
_CJK_COUNTED = re.compile(r"(\d+)\s*[遍次行个]")
_DIGITS = re.compile(r"\d+")
_SPACE = re.compile(r"\s+")


def _norm(text: str) -> str:
    """Case, digit runs and whitespace runs made alike: a line's pattern."""
    return _SPACE.sub(" ", _DIGITS.sub("0", text.lower())).strip()


def asked_copies(prompt: str) -> float:
    """How many copies of a block the prompt allows: 0 where it asks for no repetition,
    ASKED_FACTOR x the largest count it asks for, infinity where it asks without one."""
    text = prompt.lower()
    if _UNBOUNDED.search(text):
        return math.inf
    counts = [int(m.group(1).replace(",", "")) for m in _COUNTED.finditer(text)]
    counts += [int(a) * int(b) for a, b in _GRID.findall(text)]
    counts += [int(n) for n in _CJK_COUNTED.findall(text)]
    return ASKED_FACTOR * max(counts) if counts else 0.0


def in_prompt(block: str, normalized_prompt: str, short: bool) -> bool:
    """Whether the block is the prompt's own text: every line of it (digits, case and
    whitespace aside) appears in the prompt, or for a short block a run of it (two copies,
    and at least 12 characters) does. Whitespace alone, or under 8 characters of text, is
    never the prompt's."""
    if short:
        block = block * max(2, math.ceil(12 / len(block)))
    lines = [_norm(line) for line in block.split("\n")]
    lines = [line for line in lines if line]
    if sum(map(len, lines)) < 8:
        return False
    return all(line in normalized_prompt for line in lines)


def prompt_text(messages: Iterable[Mapping[str, Any]]) -> str:
    """The text of a chat's messages (every role; text parts of a multi-part content)."""
    parts: list[str] = []
    for message in messages:
        content = message.get("content")
        if isinstance(content, str):
            parts.append(content)
        elif isinstance(content, list):
            parts += [p["text"] for p in content if isinstance(p, dict) and "text" in p]
    return "\n".join(str(p) for p in parts)


class PromptAllowance:
    """What one prompt allows, read once, when the first loop is found."""

    __slots__ = ("normalized", "copies")

    def __init__(self, prompt: str) -> None:
        self.normalized = _norm(prompt)
        self.copies = asked_copies(prompt)

    def allows(self, block: str, repeats: float, short: bool) -> bool:
        """Copies within the count the prompt asks for; or, where it names no count, a
        block it holds."""
        if self.copies:
            return repeats <= self.copies
        return in_prompt(block, self.normalized, short)


# --- the detector --------------------------------------------------------------------------


class RepetitionDetector:
    """One text stream's detector (an answer has two: reasoning and content)."""

    __slots__ = (
        "rule",
        "prompt",
        "_allowance",
        "_tail",
        "_pending",
        "_seen",
        "_unchecked",
        "_run",
    )

    def __init__(self, rule: RepetitionRule, prompt: str = "") -> None:
        self.rule = rule
        self.prompt = prompt
        self._allowance: PromptAllowance | None = None
        self._tail = ""
        self._pending: list[str] = []  # fed since the last check, joined to the tail then
        self._seen = 0  # characters fed, in all; the tail holds the last of them
        self._unchecked = 0
        # The periodic run the last check found (period, first character, its block): a run
        # that outlives the tail keeps its start, so its copies are counted in full.
        self._run: tuple[int, int, str] | None = None

    @property
    def chars(self) -> int:
        """Characters fed so far."""
        return self._seen

    @property
    def tail_chars(self) -> int:
        """Characters kept: bounded by the rule, never by the length of the answer."""
        return len(self._tail) + self._unchecked

    def feed(self, delta: str) -> Loop | None:
        """Add the next piece of text; a Loop when the tail has become one.

        A piece longer than `check_every_chars` (an engine that sends what piled up while
        the reader lagged) is checked at each step of it, as small pieces would be: where the
        loop is found must not depend on how the stream was cut."""
        step = self.rule.check_every_chars
        if len(delta) > step:
            for at in range(0, len(delta), step):
                loop = self._feed(delta[at : at + step])
                if loop is not None:
                    return loop
            return None
        return self._feed(delta)

    def _feed(self, delta: str) -> Loop | None:
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
        found = self._periodic_run()
        if found is None:
            self._run = None
            return None
        period, start, block = found
        short = period < self.rule.min_block_chars
        repeats = (self._seen - start) / period
        if self._allowance is None:
            self._allowance = PromptAllowance(self.prompt)
        if self._allowance.allows(block, repeats, short):
            return None
        return Loop(
            start_char=start,
            block_chars=period,
            repeats=repeats,
            chars=self._seen,
            block=block[:EVIDENCE_CHARS],
            rule="short" if short else "block",
        )

    def _periodic_run(self) -> tuple[int, int, str] | None:
        """(period, first character, block as first written) of the loop the tail ends in."""
        tail, rule = self._tail, self.rule
        n = len(tail)
        if n < 2 * NEEDLE_CHARS:
            return None
        at = n - NEEDLE_CHARS  # the anchor: earlier copies of it name candidate periods
        anchored = False
        needle = tail[at:]
        lowest = max(0, at - rule.max_block_chars)
        end = n - 1  # excludes the needle itself
        for _ in range(MAX_CANDIDATES):
            found = tail.rfind(needle, lowest, end)
            if found < 0:
                return None
            period = at - found
            end = found + NEEDLE_CHARS - 1
            weighted = weighted_chars(tail[n - period :])
            short = period < rule.min_block_chars  # judged by its characters, not weight
            span = math.ceil(rule.span_chars(period if short else weighted) * period / weighted)
            if span > n or tail[n - span : n - period] != tail[n - span + period :]:
                if period < NEEDLE_CHARS and not anchored:
                    # The needle lies in a run of a short period too short to be a loop; its
                    # copies in that run name only multiples of it, which fail too ("ISIS-"
                    # x 60 + "\n" repeated has 60 copies 5 apart before its true period).
                    # Anchor on the run's first characters instead, once.
                    at = max(0, _run_start(tail, at, period) - NEEDLE_CHARS // 2)
                    anchored = True
                    needle = tail[at : at + NEEDLE_CHARS]
                    lowest = max(0, at - rule.max_block_chars)
                    end = at + NEEDLE_CHARS - 1
                continue
            start = _run_start(tail, n - span, period)
            absolute = self._seen - n + start
            if self._run is not None and self._run[0] == period and start == 0:
                absolute = min(absolute, self._run[1])  # the run began before the tail
                first = self._run[2]
            else:
                first = tail[start : start + period]
            self._run = (period, absolute, first)
            return self._run
        return None


def _run_start(tail: str, start: int, period: int) -> int:
    """The first index from which `tail` has `period`, given that it has it from `start`."""
    while start >= period and tail[start - period : start] == tail[start : start + period]:
        start -= period
    while start > 0 and tail[start - 1] == tail[start - 1 + period]:
        start -= 1
    return start


class AnswerGuard:
    """The guard of one answer, however it is drawn (the chat stream, `ChatStream`; ids from
    `/generate`, `Drawn`): a detector over its reasoning and one over its content. The first
    loop either finds is the answer's (`loop`, in `loop_field`); nothing is fed after it.
    Without a rule it is off and finds none."""

    __slots__ = ("_detectors", "loop", "loop_field")

    def __init__(self, rule: RepetitionRule | None = None, prompt: str = "") -> None:
        self._detectors = (
            None
            if rule is None
            else (RepetitionDetector(rule, prompt), RepetitionDetector(rule, prompt))
        )
        self.loop: Loop | None = None
        self.loop_field: str | None = None

    @property
    def on(self) -> bool:
        return self._detectors is not None

    def feed(self, reasoning: str, content: str) -> bool:
        """The answer's next reasoning and content text; True when a loop is found in it."""
        if self._detectors is None or self.loop is not None:
            return False
        for detector, name, text in zip(
            self._detectors, ("reasoning", "content"), (reasoning, content), strict=True
        ):
            loop = detector.feed(text) if text else None
            if loop is not None:
                self.loop, self.loop_field = loop, name
                return True
        return False
