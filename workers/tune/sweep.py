"""The arithmetic of `genfleet tune`, kept pure: configurations, token accounting, the best
point, the table and the settings file it writes.

`tune.command` drives the engine and reads the GPU; everything it then decides goes through
here, so the decisions are tested with tables and no engine.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from genfleet.common.errors import ConfigError
from genfleet.common.settings import Settings
from genfleet.workers.engine.sglang_argv import (
    check_adaptive,
    parse_release,
    resolve_sglang_version,
)

# SGLang's running-batch cap under speculative decoding when --max-running-requests is not
# passed (`speculative_hook.py::_handle_eagle_family`); `on:48` reproduces it on purpose.
SPEC_DEFAULT_CAP = 48
MTP_NAMES = ("on", "adaptive", "off")
# The sweep of SGLang with the engine plan: its cap for MTP off and a quarter below and above,
# and its cap for MTP on — each a fresh engine, so the state/KV split follows the cap.
PLAN_SWEEP = "off:plan*0.75,off:plan,off:plan*1.25,on:plan"
# Requests in flight at each point, sized from the cap the engine enforces (what a worker
# keeps in flight: `feeding.default_max_inflight`).
AUTO_CONCURRENCY = -1


@dataclass(frozen=True)
class TuneConfig:
    """One engine start of the sweep: MTP on, adaptive or off, and the running-batch cap.

    `adaptive` is MTP with SGLang's `--speculative-adaptive` (draft steps follow the accept
    rate and the running batch; SGLang 0.5.12+ and the emulator).

    `max_running_requests` None means "what the worker would pass": the settings' value, else
    the argv builder's default (256).

        parse_configs("on,on:48,off")  # MTP default cap, MTP capped at 48, no MTP
        parse_configs("adaptive")      # MTP with adaptive draft steps
    """

    mtp: bool
    max_running_requests: int | None = None
    adaptive: bool = False
    # A multiple of the engine plan's cap (`workers/engine/plan.py`) for this MTP choice:
    # `off:plan` is the plan, `off:plan*1.25` a quarter more requests than it fits.
    plan_scale: float | None = None
    # The radix cache kept (SGLang's own state/KV split: the argv before the plan), with
    # `--mamba-full-memory-ratio` where given: `off:radix`, `off:radix/4`.
    radix: bool = False
    mamba_ratio: float | None = None

    @property
    def label(self) -> str:
        name = "adaptive" if self.adaptive else "on" if self.mtp else "off"
        if self.radix:
            return f"{name}:radix" + ("" if self.mamba_ratio is None else f"/{self.mamba_ratio:g}")
        if self.plan_scale is not None:
            return f"{name}:plan" + ("" if self.plan_scale == 1 else f"*{self.plan_scale:g}")
        cap = self.max_running_requests
        return name if cap is None else f"{name}:{cap}"

    def planned_cap(self, plan_cap: int) -> int:
        """This point's cap for the plan's `plan_cap` (at least one request)."""
        assert self.plan_scale is not None
        return max(1, round(plan_cap * self.plan_scale))


@dataclass(frozen=True)
class Point:
    """What one (configuration, concurrency) point measured over its window.

    Power and energy come from the GPU energy counter over the window; `tokens` are the output
    tokens streamed inside the window (see `tokens_in_window`); `requests` the answers that
    ended in it.
    """

    config: str
    concurrency: int
    duration_s: float
    requests: int
    errors: int
    tokens: float
    tokens_per_s: float
    power_w: float | None
    power_limit_w: float | None
    j_per_token: float | None
    accept_length: float | None
    verdict: str
    cause: str | None = None
    other_causes: tuple[str, ...] = ()
    max_running_requests: int | None = None

    @property
    def share_of_limit(self) -> float | None:
        if self.power_w is None or not self.power_limit_w:
            return None
        return self.power_w / self.power_limit_w

    def to_json(self) -> dict[str, Any]:
        return {**asdict(self), "share_of_limit": self.share_of_limit}


def parse_concurrency(text: str) -> list[int]:
    """`"1,4,16"` → [1, 4, 16]: positive, duplicates dropped, in the order given; `auto` is
    what a worker keeps in flight for the cap the engine enforces (`AUTO_CONCURRENCY`)."""
    out: list[int] = []
    for part in text.split(","):
        part = part.strip()
        if not part:
            continue
        if part.lower() == "auto":
            if AUTO_CONCURRENCY not in out:
                out.append(AUTO_CONCURRENCY)
            continue
        if not part.isdigit() or int(part) < 1:
            raise ValueError(f"--concurrency takes positive integers or auto, got {part!r}")
        if int(part) not in out:
            out.append(int(part))
    if not out:
        raise ValueError("--concurrency needs at least one value")
    return out


def parse_configs(text: str) -> list[TuneConfig]:
    """`"on,on:48,adaptive,off"` → configurations; `NAME:N` also pins max_running_requests,
    `NAME:plan` runs the engine plan's cap, `NAME:plan*F` F times it, `NAME:radix` keeps the
    radix cache and SGLang's own split, `NAME:radix/R` with `--mamba-full-memory-ratio R`."""
    out: list[TuneConfig] = []
    for part in text.split(","):
        part = part.strip().lower()
        if not part:
            continue
        name, _, cap = part.partition(":")
        scale = _plan_scale(cap)
        radix, ratio = _radix(cap)
        bad_cap = cap and scale is None and not radix and (not cap.isdigit() or cap == "0")
        if name not in MTP_NAMES or bad_cap:
            raise ValueError(
                "--mtp takes on, adaptive, off, NAME:N, NAME:plan[*F] or NAME:radix[/R], "
                f"got {part!r}"
            )
        fixed = int(cap) if cap and scale is None and not radix else None
        config = TuneConfig(name != "off", fixed, name == "adaptive", scale, radix, ratio)
        if config not in out:
            out.append(config)
    if not out:
        raise ValueError("--mtp needs at least one of on, adaptive, off (or NAME:N)")
    return out


def _radix(cap: str) -> tuple[bool, float | None]:
    """`radix` → (True, None), `radix/4` → (True, 4.0); (False, None) for anything else."""
    head, slash, ratio = cap.partition("/")
    if head != "radix":
        return False, None
    if not slash:
        return True, None
    try:
        value = float(ratio)
    except ValueError:
        return False, None
    return (True, value) if 0 < value <= 64 else (False, None)


def _plan_scale(cap: str) -> float | None:
    """`plan` → 1.0, `plan*1.25` → 1.25; None for anything else."""
    if cap == "plan":
        return 1.0
    head, _, factor = cap.partition("*")
    if head != "plan":
        return None
    try:
        value = float(factor)
    except ValueError:
        return None
    return value if 0 < value <= 8 else None


def tokens_in_window(streamed: Iterable[tuple[float, int]], t0: float, t1: float) -> int:
    """Output tokens generated in [t0, t1], from (time, tokens) of each streamed chunk.

    Counted as they stream, not when answers end: a window shorter than its answers (a large
    batch, thinking-length answers) still reads the engine's rate, where counting finished
    answers read 0 tok/s on a GPU at 98 % of its power limit. A chunk's count may be negative
    (a usage figure correcting an estimate); it lands where it arrived.
    """
    return sum(tokens for ts, tokens in streamed if t0 <= ts <= t1)


def answer_tokens_in_window(
    requests: Iterable[tuple[float, float, int]], t0: float, t1: float
) -> float:
    """Output tokens generated in [t0, t1], from (start, end, tokens) of finished answers,
    each spread evenly over its life: for an engine whose stream says no token counts (its
    chunks' sizes unknown), where only a finished answer's count is known.
    """
    total = 0.0
    for start, end, tokens in requests:
        if end <= start:
            total += tokens if t0 <= end <= t1 else 0
            continue
        overlap = min(end, t1) - max(start, t0)
        if overlap > 0:
            total += tokens * overlap / (end - start)
    return total


def best(points: Sequence[Point]) -> tuple[Point | None, Point | None]:
    """The point with the most tokens/s, and the one with the fewest joules per token.

    Points with no tokens, or with errors on more than 1 % of their requests, never win;
    energy needs a power reading. Ties go to the lower concurrency (fewer requests in flight
    for the same result).
    """
    usable = [p for p in points if p.tokens_per_s > 0 and 100 * p.errors <= p.requests]
    fastest = max(usable, key=lambda p: (p.tokens_per_s, -p.concurrency), default=None)
    measured = [p for p in usable if p.j_per_token is not None]
    frugal = min(measured, key=lambda p: (p.j_per_token, p.concurrency), default=None)
    return fastest, frugal


def verdict_text(point: Point) -> str:
    """`underused: mtp_off (+client_limited)`: the power-watch verdict, cause and the rest."""
    if point.cause is None:
        return point.verdict
    rest = f" (+{', '.join(point.other_causes)})" if point.other_causes else ""
    return f"{point.verdict}: {point.cause}{rest}"


HEADERS = (
    "MTP",
    "C",
    "tok/s",
    "W",
    "% of limit",
    "J/token",
    "accept",
    "requests",
    "verdict",
    "best",
)


COST_HEADER = "USD/M tok"


def headers(gpu_hour_cost: float | None = None) -> tuple[str, ...]:
    """The table's columns; with a GPU-hour price, the cost per million tokens after J/token."""
    if gpu_hour_cost is None:
        return HEADERS
    at = HEADERS.index("J/token") + 1
    return (*HEADERS[:at], COST_HEADER, *HEADERS[at:])


def cost_per_million(point: Point, gpu_hour_cost: float | None, gpus: int = 1) -> float | None:
    """USD per million output tokens at this point: the `gpus` GPUs' hourly price over the
    tokens they make in an hour (None without a price or without tokens)."""
    if gpu_hour_cost is None or point.tokens_per_s <= 0:
        return None
    return gpu_hour_cost * gpus / (point.tokens_per_s * 3600) * 1e6


def _num(value: float | None, fmt: str) -> str:
    return "–" if value is None else format(value, fmt)


def table_rows(
    points: Sequence[Point], gpu_hour_cost: float | None = None, gpus: int = 1
) -> list[list[str]]:
    """The table as text cells, one row per point, `best` marking tok/s and J/token winners;
    with `gpu_hour_cost`, a cost column (see `headers`)."""
    fastest, frugal = best(points)
    rows = []
    for p in points:
        marks = [m for m, w in (("tok/s", fastest), ("J/token", frugal)) if w is p]
        share = p.share_of_limit
        requests = f"{p.requests}" + (f" ({p.errors} err)" if p.errors else "")
        rows.append(
            [
                p.config,
                str(p.concurrency),
                _num(p.tokens_per_s, ",.0f"),
                _num(p.power_w, ".0f"),
                _num(None if share is None else 100 * share, ".0f"),
                _num(p.j_per_token, ".3g"),
                *(
                    [_num(cost_per_million(p, gpu_hour_cost, gpus), ".3g")]
                    if gpu_hour_cost is not None
                    else []
                ),
                _num(p.accept_length, ".2f"),
                requests,
                verdict_text(p),
                " ".join(f"★ {m}" for m in marks),
            ]
        )
    return rows


def markdown_table(
    points: Sequence[Point], gpu_hour_cost: float | None = None, gpus: int = 1
) -> str:
    """The same table in Markdown, for bench/RESULTS.md and issue notes."""
    columns = headers(gpu_hour_cost)
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(row) + " |" for row in table_rows(points, gpu_hour_cost, gpus)]
    return "\n".join(lines)


def settings_file_text(
    point: Point,
    *,
    engine: str,
    model: str | None,
    objective: str,
    now: datetime | None = None,
) -> str:
    """The chosen point as a `--settings-file` for `genfleet worker` and `genfleet run`.

    MTP and the in-flight limit always; the running-batch cap only for engines that take it
    (SGLang and the emulator), where it is what the point ran with.
    """
    stamp = (now or datetime.now(UTC)).strftime("%Y-%m-%d %H:%M UTC")
    name = point.config.split(":", 1)[0]
    mtp = name in {"on", "adaptive"}
    lines = [
        f"# genfleet tune, {stamp}: engine {engine}, model {model or '-'}",
        f"# best by {objective}: MTP {point.config} at concurrency {point.concurrency}: "
        f"{point.tokens_per_s:,.0f} tok/s, "
        + (f"{point.j_per_token:.3g} J/token" if point.j_per_token is not None else "no power")
        + f", verdict {verdict_text(point)}",
        "# use: genfleet worker --settings-file THIS  (flags on the command line still win)",
        f"GENFLEET_MTP={'true' if mtp else 'false'}",
    ]
    if name == "adaptive":
        lines.append("GENFLEET_SPECULATIVE_ADAPTIVE=true")
    if engine in {"sglang", "emulator"} and point.max_running_requests is not None:
        lines.append(f"GENFLEET_MAX_RUNNING_REQUESTS={point.max_running_requests}")
    lines.append(f"GENFLEET_MAX_INFLIGHT={point.concurrency}")
    return "\n".join(lines) + "\n"


@dataclass
class Options:
    """The tune flags; everything else on the command line is a setting."""

    concurrency: list[int]
    configs: list[TuneConfig]
    duration_s: float = 30.0
    warmup_s: float = 5.0
    ramp_s: float = 5.0  # load before each window opens, so the window sees a steady state
    # Tokens count as they stream; only an engine that streams no token counts is read from
    # the answers that end, and those still running after the drain are left out.
    drain_s: float = 10.0
    dataset: str | None = None
    out: Path = Path("tuned.env")  # --settings-out
    json_path: Path | None = None  # --json-out
    json_stdout: bool = False  # --json
    pick: str = "throughput"


def tune_options(
    settings: Settings,
    *,
    concurrency: str | None = None,
    mtp: str | None = None,
    duration_s: float = 30.0,
    warmup_s: float = 5.0,
    ramp_s: float = 5.0,
    drain_s: float = 10.0,
    dataset: str | None = None,
    out: Path = Path("tuned.env"),
    json_path: Path | None = None,
    json_stdout: bool = False,
    pick: str = "throughput",
) -> Options:
    """The sweep the flags ask for; raises ValueError naming the flag that cannot be.

    `--mtp` defaults to `on,on:48,off` where genfleet drives MTP (SGLang, the emulator) and to
    `off` for an `--engine command` it knows no MTP switch of.
    """
    if pick not in {"throughput", "energy"}:
        raise ValueError(f"--pick takes throughput or energy, got {pick!r}")
    kind = settings.engine_kind
    if kind == "external":
        raise ValueError("tune starts its own engine, not --engine external: use --engine command")
    if duration_s <= 0:
        raise ValueError(f"--duration-s must be positive, got {duration_s:g}")
    for name, seconds in (("warmup-s", warmup_s), ("ramp-s", ramp_s), ("drain-s", drain_s)):
        if seconds < 0:
            raise ValueError(f"--{name} must not be negative, got {seconds:g}")
    default_mtp = "on,on:48,off" if kind in {"sglang", "emulator"} else "off"
    if kind == "sglang" and settings.engine_plan:
        default_mtp = PLAN_SWEEP
    configs = parse_configs(mtp or default_mtp)
    if any(config.adaptive for config in configs):
        check_adaptive_engine(settings)
    return Options(
        concurrency=parse_concurrency(concurrency or default_concurrency(configs)),
        configs=configs,
        duration_s=duration_s,
        warmup_s=warmup_s,
        ramp_s=ramp_s,
        drain_s=drain_s,
        dataset=dataset,
        out=out,
        json_path=json_path,
        json_stdout=json_stdout,
        pick=pick,
    )


def default_concurrency(configs: Sequence[TuneConfig]) -> str:
    """`auto` for a sweep of the engine plan (each cap gets what a worker would keep in
    flight), else a ladder of fixed concurrencies."""
    return "auto" if any(c.plan_scale is not None for c in configs) else "1,4,16,64,128"


def check_adaptive_engine(settings: Settings) -> None:
    """Raise ValueError unless the engine tune starts runs `--mtp adaptive` as asked.

    The emulator models it; SGLang must be 0.5.12 or later (installed, or
    `--sglang-version`) with EAGLE/EAGLE3/NEXTN and topk 1; a command engine has no MTP switch.
    """
    kind = settings.engine_kind
    if kind == "emulator":
        return
    if kind != "sglang":
        raise ValueError(f"--mtp adaptive needs --engine sglang or emulator, not {kind}")
    try:
        check_adaptive(settings, parse_release(resolve_sglang_version(settings)))
    except ConfigError as exc:
        raise ValueError(f"--mtp adaptive: {exc}") from exc
