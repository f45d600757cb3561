"""`genfleet top`: one row per GPU of the fleet, live: power against its limit, tok/s, verdict.

It reads every worker's pushed window (what the `gpu_report` inspect command returns) and
judges it with the same pure rules as the power-watch, so what `top` shows is what the watch
alerts on.
"""

from __future__ import annotations

import sys
import time
from typing import Any

import orjson
from rich import box
from rich.console import Console
from rich.live import Live
from rich.table import Table

from genfleet.common.quality import QualityTally, figures, quality_text
from genfleet.common.redis_conn import connect
from genfleet.common.settings import Settings
from genfleet.common.throughput import fleet_tokens_per_s
from genfleet.common.waste import WasteTally, waste_text
from genfleet.workers.observe.diagnosis import verdicts
from genfleet.workers.observe.node import node_rows
from genfleet.workers.observe.power_watch import snapshot

COLUMNS = (
    ("worker", "worker"),
    ("gpu", "gpu_name"),
    ("power W / limit W", None),
    ("tok/s 1m", "tokens_per_s"),
    ("tok/s 10m", "tokens_per_s_10m"),
    ("in-flight / cap", None),
    ("accept", "accept_length"),
    ("J/token", "j_per_token"),
    ("verdict", "verdict"),
    ("cause", "cause"),
)


def rows(settings: Settings) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """One verdict row per GPU (with its worker's 10-minute tok/s), and fleet tok/s."""
    client = connect(settings)
    now = time.time()
    samples, fleet = snapshot(settings, client, now)
    stale_after_s = settings.summary_ttl_s
    data = verdicts(
        samples,
        fleet,
        now,
        settings.underuse_threshold,
        settings.min_accept_length,
        stale_after_s=stale_after_s,
    )
    data += [row for row, _ in node_rows(samples, fleet, now, stale_after_s)]
    # A worker younger than the window is averaged over its own life, not the whole window.
    since = {w: float(s["first_ts"]) for w, s in samples.items() if s.get("first_ts")}
    last_10m = fleet_tokens_per_s(client, now, 600.0, since)
    fleet_waste = WasteTally()
    fleet_quality = QualityTally()
    for sample in samples.values():
        fleet_waste.merge(WasteTally.from_counters(sample.get("waste") or {}))
        fleet_quality.merge(QualityTally.from_counters(sample.get("waste") or {}))
    for row in data:
        row["tokens_per_s_10m"] = round(last_10m.get(str(row["worker"]), 0.0), 1)
        counters = samples.get(str(row["worker"]), {}).get("waste")
        if counters is not None:
            row["waste"] = WasteTally.from_counters(counters).figures()
            row["quality"] = figures(QualityTally.from_counters(counters))
    totals: dict[str, Any] = {
        "fleet_tokens_per_s_1m": round(
            fleet_tokens_per_s(client, now, 60.0, since).get("", 0.0), 1
        ),
        "fleet_tokens_per_s_10m": round(last_10m.get("", 0.0), 1),
        "waste": fleet_waste.figures(),  # since each worker started
        "quality": figures(fleet_quality),  # the answers' shares, likewise
    }
    return data, totals


def _fmt(value: Any, digits: int = 1) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.{digits}f}"
    return str(value)


# Below this many columns the ten columns' titles and figures are cut ("in-f…", "verd…"):
# each GPU's figures go in five columns, two lines a row, instead.
WIDE_COLUMNS = 120
NARROW_COLUMNS = ("worker, gpu", "W / limit", "tok/s 1m, 10m", "in flight", "verdict, cause")


def table(view: tuple[list[dict[str, Any]], dict[str, Any]], width: int = WIDE_COLUMNS) -> Table:
    """The fleet's rows as a table for a terminal `width` columns wide (narrow: five
    columns, two lines a row, so that no title or figure is cut)."""
    data, totals = view
    wide = width >= WIDE_COLUMNS
    grid = Table(
        title=f"genfleet top — {time.strftime('%H:%M:%S')}",
        expand=wide,
        box=box.HEAVY_HEAD if wide else box.SIMPLE_HEAD,
        pad_edge=wide,
    )
    titles = [title for title, _ in COLUMNS] if wide else list(NARROW_COLUMNS)
    for title in titles:
        # A verdict and a cause are words a person acts on: never folded mid-word.
        verdicts = title == "verdict, cause"
        grid.add_column(title, overflow="fold", min_width=15 if verdicts else None)
    for row in data:
        power, limit = row.get("power_w"), row.get("power_limit_w")
        share = f" ({100 * power / limit:.0f}%)" if power and limit else ""
        colour = {"ok": "green", "underused": "red", "unresponsive": "red"}.get(
            str(row.get("verdict")), "yellow"
        )
        verdict = f"[{colour}]{_fmt(row.get('verdict'))}[/]"
        watts = f"{_fmt(power, 0)} / {_fmt(limit, 0)}{share}"
        inflight = f"{_fmt(row.get('inflight'))} / {_fmt(row.get('inflight_cap'))}"
        accept, joules = _fmt(row.get("accept_length"), 2), _fmt(row.get("j_per_token"), 3)
        if wide:
            grid.add_row(
                _fmt(row.get("worker")),
                _fmt(row.get("gpu_name")),
                watts,
                _fmt(row.get("tokens_per_s")),
                _fmt(row.get("tokens_per_s_10m")),
                inflight,
                accept,
                joules,
                verdict,
                _fmt(row.get("cause")),
            )
            continue
        grid.add_row(
            f"{_fmt(row.get('worker'))}\n{_fmt(row.get('gpu_name'))}",
            watts,
            f"{_fmt(row.get('tokens_per_s'))}\n{_fmt(row.get('tokens_per_s_10m'))}",
            f"{inflight}\naccept {accept}, {joules} J",
            f"{verdict}\n{_fmt(row.get('cause'))}",
        )
    grid.caption = (
        f"fleet: {totals['fleet_tokens_per_s_1m']:,.1f} tok/s (1 min), "
        f"{totals['fleet_tokens_per_s_10m']:,.1f} tok/s (10 min, or since the oldest worker "
        "started)"
    )
    if waste := waste_text(totals.get("waste") or {}):
        grid.caption += f"\nfleet {waste} (since each worker started)"
    if answers := quality_text(totals.get("quality")):
        grid.caption += f"\nfleet {answers} (since each worker started)"
    if not data:
        grid.caption += " — no GPU worker answered (are workers running on this Redis?)"
    for row in data:
        if row.get("why"):  # an engine that needs a person: its error and the fix
            grid.caption += f"\n{row.get('worker')}: {row.get('cause')} — {row['why']}"
    return grid


def main(settings: Settings, once: bool, json_out: bool, interval_s: float = 2.0) -> None:
    if json_out:
        for row in rows(settings)[0]:
            sys.stdout.write(orjson.dumps(row).decode() + "\n")
        return
    console = Console()
    if once:
        console.print(table(rows(settings), console.width))
        return
    with Live(table(rows(settings), console.width), console=console, refresh_per_second=1) as live:
        while True:
            time.sleep(interval_s)
            live.update(table(rows(settings), console.width))
