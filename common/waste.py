"""Where a run's tokens went: kept answers, and the four kinds nobody will train on.

Every record falls in one kind, the first that applies:

- `error`: an error record (its tokens, when the engine counted any before it failed);
- `stopped`: the repetition guard stopped a loop (`finish_reason "repetition"`);
- `length`: cut at max_tokens (`finish_reason "length"`);
- `short`: an answer under `short_chars` characters of content (empty ones included);
- `kept`: everything else.

Each kind is a count of records and of generated (completion) tokens; a stopped loop also
counts the budget it did not spend (`tokens_saved`, max_tokens minus what it generated).
Apart from the records: the late copies, copies of a batch that generated it while another
copy wrote its output first (a node cut off past its lease, a message delivered twice), and
the tokens they threw away (`late_copies`, `late_copy_tokens`: the write-once put kept the
other copy's answers, so these are in no record). The
workers add a batch's tally to the run's Redis counters when its output is written (`status`
reads them); `report` tallies the records themselves. Pure: no Redis, no store.

    tally = WasteTally()
    for record in records:
        tally.add(record)
    tally.figures(j_per_token=3.6)["tokens_share"]["stopped"]   # → 0.31
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

KINDS = ("kept", "short", "length", "stopped", "error")
SHORT_CHARS = 32  # an answer under this many characters says nothing a trainer can use
STOPPED = "repetition"  # the finish_reason of an answer the repetition guard stopped


def is_stopped(record: Mapping[str, Any]) -> bool:
    """An answer the repetition guard stopped: done, never a kept answer."""
    return record.get("finish_reason") == STOPPED and not record.get("error")


def waste_kind(record: Mapping[str, Any], short: bool | None = None) -> str:
    """The kind of one output record (module docstring). `short` overrides the characters
    rule (the report's own rule, which can also count tokens)."""
    if record.get("error"):
        return "error"
    reason = record.get("finish_reason")
    if reason == STOPPED:
        return "stopped"
    if reason == "length":
        return "length"
    if short is None:
        short = len((record.get("content") or "").strip()) < SHORT_CHARS
    return "short" if short else "kept"


def _tokens(record: Mapping[str, Any]) -> int:
    return int((record.get("usage") or {}).get("completion_tokens") or 0)


def _saved(record: Mapping[str, Any]) -> int:
    loop = record.get("repetition") or {}
    return int(loop.get("tokens_saved") or 0) if isinstance(loop, Mapping) else 0


@dataclass
class WasteTally:
    """Records and tokens per kind, and the tokens the guard saved."""

    records: dict[str, int] = field(default_factory=lambda: dict.fromkeys(KINDS, 0))
    tokens: dict[str, int] = field(default_factory=lambda: dict.fromkeys(KINDS, 0))
    tokens_saved: int = 0
    late_copies: int = 0
    late_copy_tokens: int = 0

    def add(self, record: Mapping[str, Any], short: bool | None = None) -> None:
        kind = waste_kind(record, short)
        self.records[kind] += 1
        self.tokens[kind] += _tokens(record)
        if kind == "stopped":
            self.tokens_saved += _saved(record)

    def merge(self, other: WasteTally) -> None:
        for kind in KINDS:
            self.records[kind] += other.records[kind]
            self.tokens[kind] += other.tokens[kind]
        self.tokens_saved += other.tokens_saved
        self.late_copies += other.late_copies
        self.late_copy_tokens += other.late_copy_tokens

    def to_counters(self) -> dict[str, int]:
        """The run's Redis counter increments: `waste_<kind>_records`, `waste_<kind>_tokens`,
        `waste_tokens_saved`, `waste_late_copies`, `waste_late_copy_tokens` (zeros left out)."""
        counters = {f"waste_{k}_records": n for k, n in self.records.items()}
        counters |= {f"waste_{k}_tokens": n for k, n in self.tokens.items()}
        counters["waste_tokens_saved"] = self.tokens_saved
        counters["waste_late_copies"] = self.late_copies
        counters["waste_late_copy_tokens"] = self.late_copy_tokens
        return {name: value for name, value in counters.items() if value}

    @classmethod
    def from_counters(cls, counters: Mapping[str, Any]) -> WasteTally:
        tally = cls()
        for kind in KINDS:
            tally.records[kind] = int(counters.get(f"waste_{kind}_records", 0))
            tally.tokens[kind] = int(counters.get(f"waste_{kind}_tokens", 0))
        tally.tokens_saved = int(counters.get("waste_tokens_saved", 0))
        tally.late_copies = int(counters.get("waste_late_copies", 0))
        tally.late_copy_tokens = int(counters.get("waste_late_copy_tokens", 0))
        return tally

    def figures(self, j_per_token: float | None = None) -> dict[str, Any]:
        """Records, tokens and each kind's share of the generated tokens; energy per kind
        (kWh, by tokens) where the GPUs had an energy counter; the tokens the guard saved and
        their share of what the run would have generated without it."""
        generated = sum(self.tokens.values())
        share = {k: round(n / generated, 4) if generated else 0.0 for k, n in self.tokens.items()}
        energy = (
            {k: n * j_per_token / 3.6e6 for k, n in self.tokens.items()}
            if j_per_token is not None and generated
            else None
        )
        would_have = generated + self.tokens_saved
        return {
            "generated_tokens": generated,
            "records": dict(self.records),
            "tokens": dict(self.tokens),
            "tokens_share": share,
            "energy_kwh": energy,
            "loops_stopped": self.records["stopped"],
            "tokens_saved": self.tokens_saved,
            "tokens_saved_share": round(self.tokens_saved / would_have, 4) if would_have else 0.0,
            "late_copies": self.late_copies,
            "late_copy_tokens": self.late_copy_tokens,
        }

    @classmethod
    def late_copy(cls, generated_tokens: int) -> WasteTally:
        """One copy of a batch that found its output written by another: what it generated
        for nothing."""
        return cls(late_copies=1, late_copy_tokens=generated_tokens)


def waste_text(figures: Mapping[str, Any]) -> str:
    """One line: `tokens: kept 81.2%, short 2.0%, length 9.1%, stopped 7.7%, errors 0.0%;
    3 loops stopped, 96,000 tokens saved (24.1%)`; '' before any token was generated."""
    if not figures.get("generated_tokens"):
        return ""
    share = figures["tokens_share"]
    names = {"error": "errors"}
    parts = ", ".join(f"{names.get(k, k)} {share[k]:.1%}" for k in KINDS)
    line = f"tokens: {parts}"
    if figures["loops_stopped"]:
        line += (
            f"; {figures['loops_stopped']:,} loops stopped, {figures['tokens_saved']:,} tokens "
            f"saved ({figures['tokens_saved_share']:.1%})"
        )
    if figures.get("late_copies"):
        line += (
            f"; {figures['late_copies']:,} late copies of batches written by another copy "
            f"threw away {figures['late_copy_tokens']:,} tokens"
        )
    return line
