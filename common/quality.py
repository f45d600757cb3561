"""What a run's answers are worth, live: the shares of kept, empty, short, cut, stopped and
error answers, and the quality gate's decision. Pure: no Redis, no store.

An answer (one output record) can be several things at once, so the shares do not add up to
one: an answer whose reasoning used the whole budget is also cut at max_tokens and empty.

- `kept`: what a trainer keeps (common/waste.py's `kept`: no error, not stopped, not cut, at
  least `SHORT_CHARS` characters of content);
- `empty`: no content at all (whitespace only);
- `short`: under `SHORT_CHARS` characters of content, empty ones included;
- `length`: cut at max_tokens (`finish_reason "length"`);
- `reasoning_full`: cut at max_tokens with reasoning tokens and no content: the reasoning used
  the whole budget;
- `stopped`: the repetition guard stopped a loop;
- `error`: an error record;
- `shorter` (a `--regenerate` run): the new content is under `shorter_ratio` of the old
  answer's, counted among the answers that have an old one (`regenerated`).

The tally also keeps, per power of two, how many tokens the answers that finished took and
how long the old answers were (4 characters a token), so that the fix the gate gives is a
figure it saw, already rounded up to a power of two.

Workers add a batch's tally to the run's counters (common/counters.py, `quality_*` fields)
and to the run's window (common/quality_gate.py) when its output is written; `status`, `run`
and `top` read both through this module's `shares` and `quality_text`.

    tally = QualityTally()
    for row in rows:
        tally.add(row)
    shares(tally)["length"]                         # → 0.978
    judge(tally, GateSettings(), max_tokens=64, thinking=True).tripped   # → True
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from genfleet.common.previous import hint_tokens
from genfleet.common.settings import Settings
from genfleet.common.waste import SHORT_CHARS, waste_kind

KINDS = ("kept", "empty", "short", "length", "reasoning_full", "stopped", "error")
# What the gate counts as an answer nobody will keep. A stopped loop is left out: the guard
# already spent no more on it, and a run of loops is the guard's finding, not a budget's.
BAD = ("empty", "short", "length", "error")
NAMES = {
    "kept": "kept",
    "empty": "empty",
    "short": "short",
    "length": "cut at max_tokens",
    "reasoning_full": "reasoning used the whole budget",
    "stopped": "stopped",
    "error": "errors",
}
PREFIX = "quality_"  # the run counters' fields of this module


def bucket(tokens: int) -> int:
    """The power of two at or above `tokens` (1 for 0 or 1): a histogram's upper edge."""
    return 1 if tokens <= 1 else 1 << math.ceil(math.log2(tokens))


def marks(record: Mapping[str, Any]) -> list[str]:
    """The kinds (module docstring) one output record falls in."""
    if record.get("error"):
        return ["error"]
    kind = waste_kind(record)
    content = (record.get("content") or "").strip()
    found = ["kept"] if kind == "kept" else []
    if not content:
        found.append("empty")
    if len(content) < SHORT_CHARS:
        found.append("short")
    if record.get("finish_reason") == "length":
        found.append("length")
        reasoning = int((record.get("usage") or {}).get("reasoning_tokens") or 0)
        if not content and (reasoning or record.get("reasoning")):
            found.append("reasoning_full")
    if kind == "stopped":
        found.append("stopped")
    return found


@dataclass
class QualityTally:
    """Answers, each kind's count, the answers any of `BAD` covers, and the histograms."""

    answers: int = 0
    counts: dict[str, int] = field(default_factory=lambda: dict.fromkeys(KINDS, 0))
    bad: int = 0
    regenerated: int = 0
    shorter: int = 0
    finished_tokens: dict[int, int] = field(default_factory=dict)  # bucket → answers
    previous_tokens: dict[int, int] = field(default_factory=dict)  # bucket → old answers

    def add(self, record: Mapping[str, Any], shorter_ratio: float = 0.5) -> None:
        found = marks(record)
        self.answers += 1
        for kind in found:
            self.counts[kind] += 1
        if any(kind in BAD for kind in found):
            self.bad += 1
        finished = not record.get("error") and record.get("finish_reason") == "stop"
        if finished:
            tokens = int((record.get("usage") or {}).get("completion_tokens") or 0)
            _inc(self.finished_tokens, bucket(tokens))
        previous = record.get("previous")
        if isinstance(previous, Mapping) and not record.get("error"):
            self.regenerated += 1
            old = len((previous.get("content") or "").strip())
            new = len((record.get("content") or "").strip())
            if new < old * shorter_ratio:
                self.shorter += 1
            hint = hint_tokens(dict(previous))
            if hint is not None:
                _inc(self.previous_tokens, bucket(hint))

    def merge(self, other: QualityTally) -> None:
        self.answers += other.answers
        for kind in KINDS:
            self.counts[kind] += other.counts[kind]
        self.bad += other.bad
        self.regenerated += other.regenerated
        self.shorter += other.shorter
        for edge, n in other.finished_tokens.items():
            _inc(self.finished_tokens, edge, n)
        for edge, n in other.previous_tokens.items():
            _inc(self.previous_tokens, edge, n)

    def to_counters(self) -> dict[str, int]:
        """The run counters' increments (`quality_answers`, `quality_<kind>`,
        `quality_finished_le_<edge>`, ...), zeros left out."""
        fields = {
            "answers": self.answers,
            "bad": self.bad,
            "regenerated": self.regenerated,
            "shorter": self.shorter,
        }
        fields |= self.counts
        fields |= {f"finished_le_{edge}": n for edge, n in self.finished_tokens.items()}
        fields |= {f"previous_le_{edge}": n for edge, n in self.previous_tokens.items()}
        return {PREFIX + name: n for name, n in fields.items() if n}

    @classmethod
    def from_counters(cls, counters: Mapping[str, Any]) -> QualityTally:
        tally = cls()
        for name, value in counters.items():
            if not name.startswith(PREFIX):
                continue
            field_name, n = name[len(PREFIX) :], int(value)
            if field_name.startswith("finished_le_"):
                tally.finished_tokens[int(field_name[12:])] = n
            elif field_name.startswith("previous_le_"):
                tally.previous_tokens[int(field_name[12:])] = n
            elif field_name in tally.counts:
                tally.counts[field_name] = n
            elif field_name in {"answers", "bad", "regenerated", "shorter"}:
                setattr(tally, field_name, n)
        return tally


def _inc(histogram: dict[int, int], edge: int, n: int = 1) -> None:
    histogram[edge] = histogram.get(edge, 0) + n


def percentile_edge(histogram: Mapping[int, int], q: float) -> int | None:
    """The power of two at or above the `q` quantile of a histogram; None when empty."""
    total = sum(histogram.values())
    if not total:
        return None
    seen = 0
    for edge in sorted(histogram):
        seen += histogram[edge]
        if seen >= q * total:
            return edge
    return max(histogram)


def shares(tally: QualityTally) -> dict[str, float]:
    """Each kind's share of the answers (and `bad`, and `shorter` among the regenerated);
    zeros before the first answer."""
    n = tally.answers
    found = {kind: round(tally.counts[kind] / n, 4) if n else 0.0 for kind in KINDS}
    found["bad"] = round(tally.bad / n, 4) if n else 0.0
    r = tally.regenerated
    found["shorter"] = round(tally.shorter / r, 4) if r else 0.0
    return found


def figures(tally: QualityTally) -> dict[str, Any]:
    """What `status --json` shows of a tally: answers, counts and shares."""
    return {
        "answers": tally.answers,
        "counts": {**tally.counts, "bad": tally.bad, "shorter": tally.shorter},
        "regenerated": tally.regenerated,
        "shares": shares(tally),
        "finished_tokens_p95": percentile_edge(tally.finished_tokens, 0.95),
    }


def quality_text(found: Mapping[str, Any] | None) -> str:
    """`answers: 7.4% kept, 92.6% empty, 92.6% short, 97.8% cut at max_tokens, ...` (kinds
    at zero left out, kept always said); '' before the first answer."""
    if not found or not found.get("answers"):
        return ""
    share = found["shares"]
    parts = [f"{share['kept']:.1%} kept"]
    parts += [f"{share[k]:.1%} {NAMES[k]}" for k in KINDS[1:] if share[k]]
    if found.get("regenerated") and share.get("shorter"):
        parts.append(f"{share['shorter']:.1%} shorter than the old answer")
    return "answers: " + ", ".join(parts)


@dataclass(frozen=True)
class GateSettings:
    """The quality gate's thresholds (settings `quality_gate*`, `quality_window_answers`).

    Defaults, and why: 50 answers is the least at which a bad share of one half is no
    accident (at a true bad share of 0.2, 25 or more bad answers of 50 happen with
    probability under 0.1 %); a window of 200 answers follows a run that goes bad later within
    minutes on one GPU, and is short enough that the cost of reading it never grows with the
    run. One half: a run where most answers are empty, short, cut or errors wastes most of
    its GPU time, and no healthy run comes near it (healthy runs cut a few percent).
    """

    on: bool = True
    min_answers: int = 50
    window_answers: int = 200
    bad_share: float = 0.5
    shorter_ratio: float = 0.5
    shorter_share: float = 0.5

    def to_json(self) -> dict[str, Any]:
        return dict(self.__dict__)

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> GateSettings:
        known = {k: data[k] for k in cls().__dict__ if k in data}
        return cls(**known)


def gate_settings(settings: Settings) -> GateSettings:
    """The gate's settings from the one settings model (`--no-quality-gate` and the rest)."""
    return GateSettings(
        on=settings.quality_gate,
        min_answers=settings.quality_gate_min_answers,
        window_answers=settings.quality_window_answers,
        bad_share=settings.quality_gate_bad_share,
        shorter_ratio=settings.quality_gate_shorter_ratio,
        shorter_share=settings.quality_gate_shorter_share,
    )


@dataclass(frozen=True)
class Verdict:
    """The gate's decision on a window of answers: `tripped`, why (`reason`), and the fix."""

    tripped: bool
    reason: str = ""
    fix: str = ""
    answers: int = 0
    shares: dict[str, float] = field(default_factory=dict)
    suggested_max_tokens: int | None = None

    def message(self) -> str:
        return f"{self.reason}: {self.fix}" if self.fix else self.reason

    def to_json(self) -> dict[str, Any]:
        return {**self.__dict__, "message": self.message()}


def suggest_max_tokens(tally: QualityTally, max_tokens: int) -> int:
    """The --max-tokens to try: the p95 of what the answers that finished took and of the old
    answers (a regeneration), rounded up to a power of two, at least twice `max_tokens`
    (answers were cut at it, so they need more than it)."""
    seen = [
        edge
        for edge in (
            percentile_edge(tally.finished_tokens, 0.95),
            percentile_edge(tally.previous_tokens, 0.95),
        )
        if edge is not None
    ]
    return bucket(max([2 * max_tokens, *seen]))


def judge(window: QualityTally, settings: GateSettings, max_tokens: int, thinking: bool) -> Verdict:
    """Whether a run whose last answers are `window` should pause, and what to change.

    Nothing is judged before `min_answers` answers; then the run pauses when the share of
    answers that are empty, short, cut or errors reaches `bad_share`, or (a regeneration)
    when `shorter_share` of the new answers are under `shorter_ratio` of the old ones."""
    n = window.answers
    found = shares(window)
    if not settings.on or n < settings.min_answers:
        return Verdict(False, answers=n, shares=found)
    shorter = window.regenerated >= settings.min_answers and (
        found["shorter"] >= settings.shorter_share
    )
    if found["bad"] < settings.bad_share and not shorter:
        return Verdict(False, answers=n, shares=found)
    suggested: int | None = None
    if found["reasoning_full"] >= 0.5 * found["bad"] and found["reasoning_full"]:
        suggested = suggest_max_tokens(window, max_tokens)
        reason = (
            f"reasoning used all {max_tokens:,} tokens in {found['reasoning_full']:.1%} of the "
            f"last {n:,} answers ({found['empty']:.1%} empty)"
        )
        p95 = percentile_edge(window.finished_tokens, 0.95)
        if p95 is not None:
            reason += f"; the answers that finished took up to {p95:,} tokens (p95)"
        else:
            reason += f"; none finished within {max_tokens:,} tokens"
        fix = f"raise --max-tokens to {suggested:,}" + (", or --no-thinking" if thinking else "")
    elif found["length"] >= 0.5 * found["bad"] and found["length"]:
        suggested = suggest_max_tokens(window, max_tokens)
        reason = (
            f"{found['length']:.1%} of the last {n:,} answers were cut at max_tokens "
            f"({max_tokens:,})"
        )
        fix = f"raise --max-tokens to {suggested:,}"
    elif found["error"] >= 0.5 * found["bad"] and found["error"]:
        reason = f"{found['error']:.1%} of the last {n:,} answers are error records"
        fix = "read them with `genfleet report` and fix the engine or the prompts"
    elif shorter and found["bad"] < settings.bad_share:
        reason = (
            f"{found['shorter']:.1%} of the last {window.regenerated:,} new answers are under "
            f"{settings.shorter_ratio:.0%} of the old answer's length"
        )
        old = percentile_edge(window.previous_tokens, 0.95) or 0
        if old > max_tokens:
            suggested = old
            fix = f"the old answers' p95 is {old:,} tokens: raise --max-tokens to {old:,}"
        else:
            fix = (
                f"the old answers' p95 is {old:,} tokens, within --max-tokens {max_tokens:,}: "
                "check the model, its thinking and the chat template against the old answers"
            )
    else:
        reason = (
            f"{found['short']:.1%} of the last {n:,} answers are under {SHORT_CHARS} characters "
            f"({found['empty']:.1%} empty)"
        )
        fix = "check the prompts and the chat template with `genfleet report` and `export`"
    return Verdict(True, reason, fix, n, found, suggested)
