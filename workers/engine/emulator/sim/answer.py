"""A `/generate` answer token by token: a pure function of the prompt's plan and the position.

Token `i` of an answer (one id, one text piece) depends only on the plan drawn from the
prompt's seed (length, reasoning share, kind of text: plain, one of the legitimately
repetitive kinds, or a loop; see `sim/text.py`) and on `i`. So an answer continued from
position `k` (a continuation request: the prompt ids followed by the `k` ids already drawn)
is the same answer an uninterrupted request writes, from token `k` on.

The layout, by how the generation prompt left off (`sim/generation_prompt.py`):
- `think_first`: `<think>`, the reasoning, `</think>`, the family's separator, the content;
- `reasoning`: the reasoning, `</think>`, the separator, the content;
- `content`: the content alone.
The reasoning (markers included) takes the chat route's share of the answer (70 % of its
uncut length); a looping answer never leaves its reasoning. Reasoning is filler units; content
is filler units, a loop (one block repeated) or a legitimately repetitive text (tokenized line
by line, so that its ids never depend on how much of it is wanted).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from genfleet.workers.engine.emulator.sim.generation_prompt import Start
from genfleet.workers.engine.emulator.sim.text import (
    filler_unit,
    legit_line,
    loop_block_start,
)
from genfleet.workers.engine.emulator.sim.tokenizer import THINK_END, THINK_START, SimTokenizer


@dataclass(frozen=True, slots=True)
class Plan:
    """What an answer is, whichever request writes which part of it."""

    seed: int
    total: int  # tokens of the whole answer (the uninterrupted request's completion)
    start: Start
    reasoning: int  # tokens of the reasoning, its markers included (0: none)
    kind: str = "plain"  # "plain", "loop" or a legit kind
    loop_at: int = 0  # a loop's first token
    loop_block: int = 0  # a loop's block, in tokens
    loop_start: int = 0  # where the block starts in the filler stream (`loop_block_start`)

    @classmethod
    def looping(cls, seed: int, total: int, start: Start, loop_at: int, block: int) -> Plan:
        """The plan of a loop: it never leaves its reasoning (when it thinks)."""
        begin = loop_block_start(seed, block)
        return cls(seed, total, start, total, "loop", loop_at, block, begin)


class Writer:
    """Turns plans into ids and pieces for one tokenizer (and caches the legit texts' ids)."""

    def __init__(self, tokenizer: SimTokenizer, after_think: str = ""):
        self.tokenizer = tokenizer
        self.think_start = tokenizer.id_of(THINK_START)
        self.think_end = tokenizer.id_of(THINK_END)
        self.after_think = tokenizer.word_id(after_think) if after_think else None
        self._legit: dict[tuple[str, int], _LegitIds] = {}

    def token(self, plan: Plan, i: int) -> int:
        """The id of the answer's token at position `i`."""
        reasoning_end = self._reasoning_end(plan)
        if plan.start != "content":
            if plan.start == "think_first" and i == 0 and self.think_start is not None:
                return self.think_start
            if reasoning_end is None or i < reasoning_end:
                body = i - (1 if plan.start == "think_first" else 0)
                return self._reasoning(plan, body)
            if i == reasoning_end and self.think_end is not None:
                return self.think_end
            content_at = reasoning_end + 1
            if self.after_think is not None:
                if i == content_at:
                    return self.after_think
                content_at += 1
            return self._content(plan, i - content_at, plan.reasoning)
        return self._content(plan, i, 0)

    def _reasoning_end(self, plan: Plan) -> int | None:
        """Where `</think>` goes; None when the reasoning never closes (a loop)."""
        if plan.start == "content" or plan.kind == "loop":
            return None
        opened = 1 if plan.start == "think_first" else 0
        return opened + max(1, plan.reasoning - opened - 1)

    def _reasoning(self, plan: Plan, j: int) -> int:
        if plan.kind == "loop":
            return self._loop(plan, j)
        return self.tokenizer.word_id(filler_unit(plan.seed + j))

    def _content(self, plan: Plan, j: int, offset: int) -> int:
        if plan.kind == "loop":
            return self._loop(plan, j)
        if plan.kind != "plain":
            return self._legit_id(plan.kind, plan.seed % 5, j)
        return self.tokenizer.word_id(filler_unit(plan.seed + offset + j))

    def _loop(self, plan: Plan, j: int) -> int:
        if j < plan.loop_at:
            return self.tokenizer.word_id(filler_unit(plan.seed + j))
        block_unit = plan.loop_start + (j - plan.loop_at) % plan.loop_block
        return self.tokenizer.word_id(filler_unit(block_unit))

    def _legit_id(self, kind: str, variant: int, j: int) -> int:
        text = self._legit.get((kind, variant))
        if text is None:
            text = self._legit[(kind, variant)] = _LegitIds()
        while len(text.ids) <= j:
            text.ids.extend(self.tokenizer.encode(legit_line(kind, text.lines, variant)))
            text.lines += 1
        return text.ids[j]


@dataclass(slots=True)
class _LegitIds:
    """A legitimately repetitive text's ids so far, and the lines they cover."""

    ids: list[int] = field(default_factory=list)
    lines: int = 0


class Answer:
    """The part of one answer a request writes: tokens `offset` … of `plan`, materialised
    as they are needed (ids and their text pieces)."""

    def __init__(self, writer: Writer, plan: Plan, offset: int):
        self.writer = writer
        self.plan = plan
        self.offset = offset
        self.ids: list[int] = []
        self.pieces: list[str] = []

    def upto(self, n: int) -> None:
        """Make the first `n` tokens of this request's part available."""
        piece = self.writer.tokenizer.piece
        token = self.writer.token
        for i in range(len(self.ids), n):
            token_id = token(self.plan, self.offset + i)
            self.ids.append(token_id)
            self.pieces.append(piece(token_id))

    def text(self, begin: int, end: int) -> str:
        """The text of this request's tokens [begin, end)."""
        self.upto(end)
        return "".join(self.pieces[begin:end])
