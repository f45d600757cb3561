"""`genfleet report`: is this run worth training on? Counted before anyone finds out the hard way.

One streaming pass over the run's output objects (the same deduplicated, input-ordered records
`export` writes) counts finish reasons, errors by type, empty and short answers and answers
with reasoning but no content, loops the repetition guard stopped (never counted as answers
worth keeping), the distribution of completion and reasoning tokens, and where the generated
tokens went (`waste`: kept, short, cut at max_tokens, stopped, errors; common/waste.py).

Percentiles are exact and memory is bounded by the number of distinct token counts, not by
the number of records: each distribution is a histogram (count per token value), and a
token count cannot exceed the run's max_tokens, so a 900K-record run capped at 8192 tokens
keeps at most 8192 entries per histogram. p50/p90 are nearest-rank: the smallest value with
at least that share of records at or below it.
"""

from __future__ import annotations

import io
import math
from collections import Counter
from typing import Any

from genfleet.common.settings import Settings
from genfleet.common.waste import KINDS, STOPPED, WasteTally
from genfleet.producer.export import answers, scan_run
from genfleet.producer.tries import TryCounts

SHORT_CHARS = 32  # an answer under this many characters says nothing a trainer can use
THRESHOLD = 0.10  # a run whose share of a bad kind of answer exceeds this is flagged


def distribution(histogram: Counter[int]) -> dict[str, float | int]:
    """{mean, p50, p90, max} of a value → count histogram (exact, nearest-rank)."""
    total = sum(histogram.values())
    if not total:
        return {"mean": 0.0, "p50": 0, "p90": 0, "max": 0}
    values = sorted(histogram)
    mean = sum(value * count for value, count in histogram.items()) / total
    result: dict[str, float | int] = {"mean": round(mean, 2)}
    for name, share in (("p50", 0.5), ("p90", 0.9)):
        rank = max(1, math.ceil(share * total))
        seen = 0
        for value in values:
            seen += histogram[value]
            if seen >= rank:
                result[name] = value
                break
    result["max"] = values[-1]
    return result


def _share(part: int, whole: int) -> float:
    return part / whole if whole else 0.0


def _flags(report: dict[str, Any], threshold: float) -> list[str]:
    """One line per problem a person should look at before training on the run."""
    flags: list[str] = []
    # a stopped loop is neither an error nor an answer: counted apart, out of the answer shares
    answers = report["records"] - report["errors"] - report.get("stopped", 0)
    checks = (
        ("short_or_empty_answers", report["short_answers"], answers),
        ("length_capped", report["length_capped"], answers),
        ("stopped_loops", report.get("stopped", 0), report["records"]),
        ("reasoning_without_content", report["reasoning_without_content"], answers),
        ("errors", report["errors"], report["records"]),
    )
    for name, part, whole in checks:
        share = _share(part, whole)
        if share > threshold:
            flags.append(f"{name} {share:.1%} > {threshold:.0%}")
    if report["batches_missing"]:
        flags.append(
            f"incomplete: {report['batches_missing']} of {report['batches_total']} batches "
            "have no output"
        )
    if not report["records"]:
        flags.append("no records")
    return flags


class PreviousAnswers:
    """Old answers (`--regenerate`'s `previous`) against the new ones of the same records.

    Both sides are judged by the same rule on the text: empty, and short under `short_chars`
    characters (the old answers have no token counts, so the token rule is not applied here).
    Lengths are in characters on both sides, histograms as for tokens (exact percentiles).
    New answers that are error records count on the old side only.
    """

    def __init__(self, short_chars: int) -> None:
        self.short_chars = short_chars
        self.count = self.answered = 0
        self.empty = {"previous": 0, "new": 0}
        self.short = {"previous": 0, "new": 0}
        self.with_reasoning = {"previous": 0, "new": 0}
        self.short_replaced = 0  # a short old answer whose new one is not short
        # multi-turn: conversations whose last answer was replaced and whose older assistant
        # turns were kept, sent as the context the new answer follows
        self.with_earlier_answers = 0
        self.content: dict[str, Counter[int]] = {"previous": Counter(), "new": Counter()}
        self.reasoning: dict[str, Counter[int]] = {"previous": Counter(), "new": Counter()}

    def _side(self, side: str, content: str, reasoning: str) -> bool:
        """Count one answer; whether it is short."""
        self.content[side][len(content)] += 1
        self.reasoning[side][len(reasoning)] += 1
        self.empty[side] += not content
        self.with_reasoning[side] += bool(reasoning)
        short = len(content) < self.short_chars
        self.short[side] += short
        return short

    def add(self, record: dict[str, Any]) -> None:
        previous = record.get("previous")
        if not isinstance(previous, dict):
            return
        self.count += 1
        messages = record.get("messages") or []
        self.with_earlier_answers += any(
            isinstance(m, dict) and m.get("role") == "assistant" for m in messages
        )
        was_short = self._side(
            "previous",
            (previous.get("content") or "").strip(),
            (previous.get("reasoning") or "").strip(),
        )
        if record.get("error"):
            return
        self.answered += 1
        content = (record.get("content") or "").strip()
        is_short = self._side("new", content, (record.get("reasoning") or "").strip())
        self.short_replaced += was_short and not is_short

    def to_json(self) -> dict[str, Any] | None:
        if not self.count:
            return None
        wholes = {"previous": self.count, "new": self.answered}
        return {
            "count": self.count,
            "answered": self.answered,
            "short_chars": self.short_chars,
            "empty_fraction": round(_share(self.empty["previous"], self.count), 4),
            "short_fraction": round(_share(self.short["previous"], self.count), 4),
            "new_empty_fraction": round(_share(self.empty["new"], self.answered), 4),
            "new_short_fraction": round(_share(self.short["new"], self.answered), 4),
            "short_replaced": self.short_replaced,
            "with_earlier_answers": self.with_earlier_answers,
            "with_reasoning_fraction": {
                side: round(_share(self.with_reasoning[side], wholes[side]), 4) for side in wholes
            },
            "content_chars": {side: distribution(self.content[side]) for side in wholes},
            "reasoning_chars": {side: distribution(self.reasoning[side]) for side in wholes},
        }


def previous_table(previous: dict[str, Any]) -> Any:
    """The old answers beside the new ones, as a rich table."""
    from rich.table import Table

    table = Table(title=f"previous vs new ({previous['count']:,} regenerated answers)")
    for column, justify in (("", "left"), ("previous", "right"), ("new", "right")):
        table.add_column(column, justify=justify)  # type: ignore[arg-type]
    table.add_row(
        "empty answers",
        f"{previous['empty_fraction']:.1%}",
        f"{previous['new_empty_fraction']:.1%}",
    )
    table.add_row(
        f"short answers (< {previous['short_chars']} chars)",
        f"{previous['short_fraction']:.1%}",
        f"{previous['new_short_fraction']:.1%}",
    )
    reasoning = previous["with_reasoning_fraction"]
    table.add_row("with reasoning", f"{reasoning['previous']:.1%}", f"{reasoning['new']:.1%}")
    for name in ("content_chars", "reasoning_chars"):
        old, new = previous[name]["previous"], previous[name]["new"]
        for stat in ("mean", "p50", "p90", "max"):
            table.add_row(f"{name} {stat}", f"{old[stat]:,}", f"{new[stat]:,}")
    table.add_row("short answers replaced", "", f"{previous['short_replaced']:,}")
    table.add_row(
        "older answers kept as context",
        "",
        f"{previous.get('with_earlier_answers', 0):,}",
    )
    return table


def build_report(
    settings: Settings,
    run: str,
    short_chars: int = SHORT_CHARS,
    threshold: float = THRESHOLD,
    short_tokens: int | None = None,
) -> dict[str, Any]:
    """The run's quality report as one JSON-ready object, finished or not.

    An answer (the content, stripped) is short when it has fewer than `short_chars`
    characters, or fewer than `short_tokens` content tokens (completion minus reasoning
    tokens) when that is given; `short_answers` includes the empty ones, which
    `empty_answers` counts on their own. Error records count in `errors` and
    `errors_by_type` only, not in the answer statistics; answers the repetition guard stopped
    count in `stopped` (and `finish_reasons`, `waste`) only, likewise. Each record counts its
    standing answer (a retry's over the original, producer/tries.py), as `export` writes it.
    """
    scan = scan_run(settings, run)
    finish: Counter[str] = Counter()
    errors_by_type: Counter[str] = Counter()
    completion: Counter[int] = Counter()
    reasoning: Counter[int] = Counter()
    records = empty = short = reasoning_only = 0
    waste = WasteTally()
    old_answers = PreviousAnswers(short_chars)
    tries = TryCounts()
    for record in answers(scan, tries):  # each record's standing answer, as export writes
        records += 1
        old_answers.add(record)
        error = record.get("error")
        if error:
            waste.add(record)
            errors_by_type[str(error.get("type") or "error")] += 1
            continue
        finish[str(record.get("finish_reason"))] += 1
        if record.get("finish_reason") == STOPPED:  # counted apart, never as an answer
            waste.add(record)
            continue
        usage = record.get("usage") or {}
        completion_tokens = int(usage.get("completion_tokens") or 0)
        reasoning_tokens = int(usage.get("reasoning_tokens") or 0)
        completion[completion_tokens] += 1
        reasoning[reasoning_tokens] += 1
        content = (record.get("content") or "").strip()
        if not content:
            empty += 1
            if (record.get("reasoning") or "").strip():
                reasoning_only += 1
        content_tokens = completion_tokens - reasoning_tokens
        few_tokens = short_tokens is not None and content_tokens < short_tokens
        is_short = len(content) < short_chars or few_tokens
        if is_short:
            short += 1
        waste.add(record, is_short)
    report: dict[str, Any] = {
        "run": run,
        "batches_total": scan.manifest.batches_total,
        "batches_done": scan.batches_read,
        "batches_missing": len(scan.missing),
        "records": records,
        "duplicates": scan.duplicates,
        "errors": sum(errors_by_type.values()),
        "errors_by_type": dict(errors_by_type.most_common()),
        "finish_reasons": dict(finish.most_common()),
        "length_capped": finish.get("length", 0),
        "completion_tokens": distribution(completion),
        "reasoning_tokens": distribution(reasoning),
        "empty_answers": empty,
        "short_answers": short,
        "reasoning_without_content": reasoning_only,
        "short_chars": short_chars,
        "short_tokens": short_tokens,
        "threshold": threshold,
    }
    report["stopped"] = finish.get(STOPPED, 0)
    # `genfleet retry RUN --errors/--stopped/--cut`: records given another try, those now
    # answered by a retry, and those of them that are kept answers (export counts the same).
    report["retried"] = tries.retried
    report["retried_replaced"] = tries.replaced
    report["retried_kept"] = tries.kept
    report["retries_pending"] = tries.pending
    report["previous"] = old_answers.to_json()  # None: the run replaced no old answers
    report["flags"] = _flags(report, threshold)
    report["energy"] = _energy(settings, run)
    j_per_token = report["energy"]["j_per_token"] if report["energy"] else None
    report["waste"] = waste.figures(j_per_token)
    return report


def _energy(settings: Settings, run: str) -> dict[str, Any] | None:
    """What the run's GPUs spent, from the workers' counters in Redis; None (said so in the
    text) when Redis cannot be reached: the report itself needs only the store."""
    import redis

    from genfleet.common import counters
    from genfleet.producer.status import energy_figures

    try:
        client = redis.Redis.from_url(
            settings.redis_url.get_secret_value(), socket_connect_timeout=3, socket_timeout=5
        )
        found = counters.read(client, run)
        client.close()
    except redis.RedisError:
        return None
    return energy_figures(found, settings.gpu_hour_cost)


def waste_table(figures: dict[str, Any] | None) -> Any:
    """Where the tokens went: each kind's records, tokens and share (and kWh where measured),
    then the tokens the repetition guard saved."""
    from rich.table import Table

    grid = Table(title="where the tokens went")
    for column in ("kind", "records", "tokens", "share", "kWh"):
        grid.add_column(column, justify="left" if column == "kind" else "right")
    if not figures:
        return grid
    energy = figures.get("energy_kwh") or {}
    names = {"short": "short or empty", "length": "cut at max_tokens", "stopped": "loops stopped"}
    for kind in KINDS:
        kwh = f"{energy[kind]:.4g}" if kind in energy else "-"
        grid.add_row(
            names.get(kind, kind),
            f"{figures['records'][kind]:,}",
            f"{figures['tokens'][kind]:,}",
            f"{figures['tokens_share'][kind]:.1%}",
            kwh,
        )
    grid.caption = (
        f"repetition guard: {figures['tokens_saved']:,} tokens saved "
        f"({figures['tokens_saved_share']:.1%} of what the run would have generated)"
    )
    return grid


def render_report(report: dict[str, Any]) -> str:
    """The report as text tables, for a terminal or a log."""
    from rich.console import Console
    from rich.table import Table

    answers = report["records"] - report["errors"] - report.get("stopped", 0)
    summary = Table(title=f"run {report['run']}", show_header=False)
    summary.add_column("what")
    summary.add_column("count", justify="right")
    summary.add_column("share", justify="right")
    rows: list[tuple[str, int, int | None]] = [
        ("batches done", report["batches_done"], report["batches_total"]),
        ("records", report["records"], None),
        ("errors", report["errors"], report["records"]),
        ("length capped", report["length_capped"], answers),
        ("loops stopped (repetition)", report.get("stopped", 0), report["records"]),
        ("empty answers", report["empty_answers"], answers),
        (f"short answers (< {report['short_chars']} chars)", report["short_answers"], answers),
        ("reasoning without content", report["reasoning_without_content"], answers),
        ("duplicates dropped", report["duplicates"], None),
        ("retried (genfleet retry)", report.get("retried", 0), report["records"]),
        ("retried, answered by a retry", report.get("retried_replaced", 0), None),
        ("retried, now kept", report.get("retried_kept", 0), None),
        ("retry batches not done yet", report.get("retries_pending", 0), None),
    ]
    for name, count, whole in rows:
        share = f"{_share(count, whole):.1%}" if whole is not None else ""
        summary.add_row(name, f"{count:,}", share)

    tokens = Table(title="tokens per answer")
    tokens.add_column("")
    for column in ("mean", "p50", "p90", "max"):
        tokens.add_column(column, justify="right")
    for name in ("completion_tokens", "reasoning_tokens"):
        stats = report[name]
        tokens.add_row(name, *(f"{stats[c]:,}" for c in ("mean", "p50", "p90", "max")))

    reasons = Table(title="finish reasons and errors")
    reasons.add_column("kind")
    reasons.add_column("count", justify="right")
    for reason, count in report["finish_reasons"].items():
        reasons.add_row(f"finish: {reason}", f"{count:,}")
    for kind, count in report["errors_by_type"].items():
        reasons.add_row(f"error: {kind}", f"{count:,}")

    buffer = io.StringIO()
    console = Console(file=buffer, width=100, force_terminal=False, color_system=None)
    for table in (summary, tokens, reasons, waste_table(report.get("waste"))):
        console.print(table)
    if report.get("previous"):
        console.print(previous_table(report["previous"]))
    flags = report["flags"]
    console.print("flags: " + ("; ".join(flags) if flags else "none"))
    from genfleet.producer.status import energy_text

    energy = report.get("energy")
    console.print(
        "energy: "
        + ((energy_text(energy) or "not measured") if energy else "unknown (Redis unreachable)")
    )
    return buffer.getvalue()
