"""An answer drawn so far: its token ids and its text, kept across every cut until it ends.

When the engine dies or the worker is killed mid-answer, the answer goes on from the ids the
model already drew (prompt ids + drawn ids to `/generate`, its token budget less what was
drawn), never from its text tokenized again. Sampling depends only on the prefix, so the
continued answer is the model's answer; engines re-prefill the same way when they retract a
request. What rides along: the reasoning/content split (`ReasoningSplit`), the repetition
guard's two windows (fed again from the text when an answer comes back from a checkpoint), and
how many tokens were carried in (`resumed_tokens`, on the record).

`to_json` / `from_json` are what a batch's checkpoint keeps of an answer in flight (a row with
a `drawn` field), so a batch that moves to another worker continues its answers too. Between
two checkpoints, `since` / `extend` carry what an answer drew after a point (`Mark`) to the
batch's journal in Redis and back (`workers/drawn_journal`), so a lost worker costs each answer
only its last few tokens, not what it drew since the last checkpoint.
"""

from __future__ import annotations

from array import array
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from genfleet.workers.feeding.reasoning import ReasoningSplit
from genfleet.workers.feeding.repetition import AnswerGuard, RepetitionRule


def worth_keeping(drawn_tokens: int, kept_tokens: int | None) -> bool:
    """Whether an answer in flight (`drawn_tokens` drawn; `kept_tokens` in the copy its batch's
    checkpoint holds, None: never kept) goes into the next checkpoint: whenever it drew a token
    since. A lost worker costs each answer what it drew since its copy, so the checkpoint
    interval alone sets that cost. (Keeping an answer only once it drew 64 tokens more saved
    rewriting ids, but at a checkpoint every 2 s an answer drawing 34 tokens a second in a full
    engine was kept every other checkpoint, a young one not at all: a lost worker cost 40
    tokens per answer in flight, 7 % of a chaos run's tokens.)

    >>> worth_keeping(10, None), worth_keeping(0, None), worth_keeping(100, 100)
    (True, False, False)
    """
    return drawn_tokens > (kept_tokens or 0)


def copy_of(
    live: Mapping[tuple[str, int], Drawn], saved: dict[tuple[str, int], int]
) -> list[tuple[tuple[str, int], Drawn, dict[str, Any], Mark]]:
    """A batch's answers in flight as its next checkpoint copies them, each with its mark:
    every one that drew a token, as soon as `worth_keeping` says so of any of them against
    what `saved` (updated here) says was kept last; else none. Each copy is whole, so the one
    before can go."""
    answers = [(name, drawn) for name, drawn in live.items() if len(drawn.ids)]
    if not any(worth_keeping(len(drawn.ids), saved.get(name)) for name, drawn in answers):
        return []
    rows = []
    for name, drawn in answers:
        saved[name] = len(drawn.ids)
        rows.append((name, drawn, drawn.to_json(), drawn.mark()))
    return rows


@dataclass(slots=True)
class Drawn:
    """One answer's ids and text so far (the feeder's, per prompt)."""

    in_reasoning: bool  # thinking on with a reasoning parser: the answer opens in reasoning
    prompt_ids: list[int] | None = None  # the rendered prompt, once rendered
    # 4 bytes an id, not a Python int's 36: a thinking answer holds tens of thousands
    ids: array[int] = field(default_factory=lambda: array("I"))
    reasoning: list[str] = field(default_factory=list)
    content: list[str] = field(default_factory=list)
    resumed_tokens: int = 0  # tokens carried into continuations, over all of its cuts
    split: ReasoningSplit = field(init=False)
    guard: AnswerGuard = field(default_factory=AnswerGuard)  # off until `watch`
    # The engine said the answer ended (any finish but an abort): it is no longer kept in
    # flight, since going on from all of its ids would draw past its end (an EOS among them).
    ended: bool = False
    retexts: int = 0  # its text was decoded again (`retext`): what a `Mark` held is stale

    def __post_init__(self) -> None:
        self.split = ReasoningSplit(self.in_reasoning)

    def watch(self, rule: RepetitionRule | None, prompt: str) -> None:
        """Start the guard (once): fed the text already drawn, so its window spans the cut."""
        if rule is None or self.guard.on:
            return
        self.guard = AnswerGuard(rule, prompt)
        self.guard.feed("".join(self.reasoning), "".join(self.content))

    def add(self, ids: list[int], text: str) -> bool:
        """Ids and their text from the engine; True when the guard says stop."""
        self.ids.extend(ids)
        if not text:
            return False
        reasoning, content = self.split.feed(text)
        return self._text(reasoning, content)

    def finish(self) -> bool:
        """The answer ended: text held back as a possible marker is text after all."""
        return self._text(*self.split.flush())

    def retext(self, text: str) -> None:
        """The answer's whole text, decoded again from its ids: split anew, as streamed."""
        self.retexts += 1
        self.split = ReasoningSplit(self.in_reasoning)
        self.reasoning, self.content = [], []
        reasoning, content = self.split.feed(text)
        more_reasoning, more_content = self.split.flush()
        self.reasoning = [reasoning + more_reasoning] if reasoning + more_reasoning else []
        self.content = [content + more_content] if content + more_content else []

    def _text(self, reasoning: str, content: str) -> bool:
        if reasoning:
            self.reasoning.append(reasoning)
        if content:
            self.content.append(content)
        return self.guard.feed(reasoning, content)

    @property
    def chars(self) -> int:
        return sum(map(len, self.reasoning)) + sum(map(len, self.content))

    def to_json(self) -> dict[str, Any]:
        """What a checkpoint keeps: enough to go on from the same ids with the same split."""
        return {
            "ids": list(self.ids),
            "reasoning": "".join(self.reasoning),
            "content": "".join(self.content),
            **self._state(),
        }

    def mark(self) -> Mark:
        """How much of the answer there is now: what a later `since` starts after."""
        state = tuple(self._state().values())
        return Mark(len(self.ids), len(self.reasoning), len(self.content), self.retexts, state)

    def since(self, mark: Mark) -> dict[str, Any] | None:
        """What the answer added after `mark`: its ids from `from`, their text, and the
        split's state after them when it is not `mark`'s (a line a second for every answer in
        flight: what is unchanged is left out). For `extend` on a copy that holds `mark.ids`
        ids; None when nothing was added or its text was decoded again since (the pieces no
        longer add up)."""
        if mark.retexts != self.retexts or len(self.ids) <= mark.ids:
            return None
        delta: dict[str, Any] = {"from": mark.ids, "ids": self.ids[mark.ids :].tolist()}
        if reasoning := "".join(self.reasoning[mark.reasoning :]):
            delta["reasoning"] = reasoning
        if content := "".join(self.content[mark.content :]):
            delta["content"] = content
        state = self._state()
        if tuple(state.values()) != mark.state:
            delta.update(state)
        return delta

    def extend(self, delta: dict[str, Any]) -> bool:
        """Add what `since` gave, when it goes on from exactly this many ids; else nothing
        and False (a delta of another point never joins this answer)."""
        opened = delta.get("opened_in_reasoning", self.in_reasoning)
        if delta["from"] != len(self.ids) or bool(opened) != self.in_reasoning:
            return False
        self.ids.extend(int(i) for i in delta["ids"])
        if delta.get("reasoning"):
            self.reasoning.append(delta["reasoning"])
        if delta.get("content"):
            self.content.append(delta["content"])
        if "in_reasoning" in delta:  # else the state is the one before
            self._restore(delta)
        return True

    def _state(self) -> dict[str, Any]:
        return {
            "in_reasoning": self.split.in_reasoning,
            "started": self.split.started,
            "held": self.split.held,
            "content_begun": self.split.content_begun,
            "opened_in_reasoning": self.in_reasoning,
            "resumed_tokens": self.resumed_tokens,
        }

    def _restore(self, data: dict[str, Any]) -> None:
        self.resumed_tokens = int(data.get("resumed_tokens") or 0)
        self.split.restore(
            in_reasoning=bool(data["in_reasoning"]),
            started=bool(data["started"]),
            held=str(data.get("held") or ""),
            content_begun=bool(data["content_begun"]),
        )

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Drawn:
        drawn = cls(bool(data["opened_in_reasoning"]))
        drawn.ids = array("I", (int(i) for i in data["ids"]))
        drawn.reasoning = [data["reasoning"]] if data.get("reasoning") else []
        drawn.content = [data["content"]] if data.get("content") else []
        drawn._restore(data)
        return drawn

    @classmethod
    def begun(cls, delta: dict[str, Any]) -> Drawn:
        """An answer with no ids yet, opened as `delta`'s was (a first delta holds the state:
        nothing is marked before it): what a delta `from` 0 extends."""
        return cls(bool(delta["opened_in_reasoning"]))


@dataclass(frozen=True, slots=True)
class Mark:
    """How much of an answer a copy holds: its ids, its text pieces, its `retexts`, and its
    split's state (None: none known, as before a first delta)."""

    ids: int
    reasoning: int
    content: int
    retexts: int
    state: tuple[Any, ...] | None = None
