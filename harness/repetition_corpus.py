"""The labelled corpus of real texts the repetition guard is measured on, and the measure.

`tests/data/repetition/corpus.jsonl` holds one text a line (sources and licences in
`tests/data/README.md`): `legit` texts (tables, code, lists, digits, songs, ASCII art, JSON,
SQL, and exact repetition a prompt asked for) that must never be stopped, and `loop` texts
(loops models produced, quoted in public issue threads) that must be stopped within 2,000
tokens of where they start. A loop is stored as the quoted text before it (`text`) and its
block (`loop_block`, `loop_repeats` copies): the model would have gone on repeating it.

`score` streams every text through a detector in chunks, as the feeder does, with the
prompt or without it; the figures are what `bench/waste.py` prints and what the tests hold.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from genfleet.workers.feeding.repetition import token_estimate

CORPUS = Path(__file__).resolve().parent.parent / "tests" / "data" / "repetition" / "corpus.jsonl"
CHUNK_CHARS = 128  # SGLang with --stream-interval 32 (coarser than genfleet's 8), 4 chars a token
BUDGET_TOKENS = 2000  # a loop must be stopped within this many tokens of its start


@dataclass(frozen=True, slots=True)
class Text:
    """One labelled text; `loop_start_char` is where a loop's first copy begins."""

    id: str
    label: str  # "legit" or "loop"
    kind: str
    prompt: str
    text: str
    loop_start_char: int | None
    source: str


def load_corpus(path: Path = CORPUS) -> list[Text]:
    """The corpus; a bad line is an error naming the file, the line and the field."""
    texts = []
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        try:
            row: dict[str, Any] = json.loads(line)
            label = row["label"]
            if label not in ("legit", "loop"):
                raise ValueError(f"label {label!r} is neither 'legit' nor 'loop'")
            text = row["text"]
            start = None
            if label == "loop":
                start = int(row["loop_start_char"])
                text += row["loop_block"] * int(row["loop_repeats"])
            texts.append(
                Text(row["id"], label, row["kind"], row["prompt"], text, start, row["source"])
            )
        except (KeyError, ValueError, TypeError) as exc:
            raise ValueError(f"{path}, line {number}: {exc!r}") from exc
    return texts


class Detector(Protocol):
    def feed(self, delta: str) -> object | None: ...


@dataclass
class Score:
    """False stops (legit texts stopped; loop texts stopped before their loop began), loops
    caught within the budget, caught late, and missed."""

    legit: int = 0
    loops: int = 0
    false_stops: list[str] = field(default_factory=list)
    caught: list[str] = field(default_factory=list)
    late: list[str] = field(default_factory=list)
    missed: list[str] = field(default_factory=list)
    tokens_to_stop: list[float] = field(default_factory=list)  # per loop caught

    @property
    def catch_share(self) -> float:
        return len(self.caught) / self.loops if self.loops else 1.0

    def line(self) -> str:
        worst = max(self.tokens_to_stop, default=0)
        return (
            f"{len(self.false_stops)} false stops of {self.legit} legit texts, "
            f"{len(self.caught)}/{self.loops} loops stopped within {BUDGET_TOKENS:,} tokens "
            f"({self.catch_share:.1%}; slowest {worst:,.0f} tokens), {len(self.late)} late, "
            f"{len(self.missed)} missed"
        )


def stopped_at(detector: Detector, text: str, chunk: int = CHUNK_CHARS) -> int | None:
    """Characters fed when the detector stopped the text (None: never)."""
    for at in range(0, len(text), chunk):
        if detector.feed(text[at : at + chunk]) is not None:
            return min(at + chunk, len(text))
    return None


def score(
    texts: list[Text],
    detector: Callable[[str], Detector],
    with_prompt: bool = True,
    chunk: int = CHUNK_CHARS,
) -> Score:
    """Every text through a fresh detector (`detector(prompt)`), the prompt given or not,
    in chunks of `chunk` characters."""
    result = Score()
    for text in texts:
        at = stopped_at(detector(text.prompt if with_prompt else ""), text.text, chunk)
        if text.loop_start_char is None:
            result.legit += 1
            if at is not None:
                result.false_stops.append(text.id)
            continue
        result.loops += 1
        if at is None:
            result.missed.append(text.id)
        elif at <= text.loop_start_char:
            result.false_stops.append(text.id)
        else:
            tokens = token_estimate(text.text[text.loop_start_char : at])
            (result.caught if tokens <= BUDGET_TOKENS else result.late).append(text.id)
            result.tokens_to_stop.append(tokens)
    return result
