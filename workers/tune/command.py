"""`genfleet tune`: sweep MTP configurations × client concurrency on this node's engine.

    genfleet tune --model PATH [--engine sglang|emulator|command ...] [--concurrency 1,4,16,64]
                  [--mtp on,on:48,off] [--duration-s 30] [--warmup-s 5] [--ramp-s 5]
                  [--drain-s 10] [--dataset FILE]
                  [--settings-out tuned.env] [--json-out results.json] [--json]
                  [--pick throughput|energy] [any setting ...]

Use it once per (model, GPU type, engine version) before a large run. For each configuration
it starts the engine through the worker's own supervisor (same argv, same readiness), warms it
up, then keeps exactly C requests in flight at each concurrency C, measuring `--duration-s`
after `--ramp-s` (so the window sees a steady state, not the first burst), with
prompts from `--dataset` (any format `enqueue` reads) or a built-in set. Per point it records
output tok/s (the tokens streamed inside the window, so a window shorter than the answers
still reads the engine's rate; an engine whose stream says no token counts is read from the
answers that end by `--drain-s` after the window), mean power and its share of the enforced
limit from the GPU energy counter, J/token, the accept length where the engine reports one,
and the power-watch verdict for "work waits" (a fleet whose queue is never empty). It prints
the table, marks the best point by tok/s and by J/token, and writes the chosen one as a
settings file for `worker`/`run` (`--settings-out`). Every point goes to `--json-out FILE`,
or with `--json` to stdout (the table then goes to stderr).

Configurations (`--mtp`): `on`, `off`, and `on:N`/`off:N` pinning `--max-running-requests N`.
The default for SGLang and the emulator is `on,on:48,off`: `on:48` is what SGLang silently
does with speculative decoding when the flag is not passed, so the table shows what passing
it buys at high concurrency. Engines launched from `--engine-command` have no MTP switch that
genfleet knows of: their default is `off` alone.
"""

from __future__ import annotations

import itertools
import logging
import signal
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import orjson
import typer
from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from genfleet.common.errors import GenfleetError
from genfleet.common.flags import fail
from genfleet.common.records import GenerationParams, PromptRecord
from genfleet.common.settings import Settings
from genfleet.workers.engine.families import choose
from genfleet.workers.engine.kinds import engine_launch, planned, with_engine_key
from genfleet.workers.engine.plan import (
    DEFAULT_MAX_RUNNING_REQUESTS,
    PLAN_MEM_FRACTION,
    EnginePlan,
)
from genfleet.workers.engine.ports import pick_port, private_dir
from genfleet.workers.engine.preflight import checkpoint_arch
from genfleet.workers.engine.supervisor import EngineSupervisor
from genfleet.workers.feeding import EngineClient, ThinkingSwitch, default_max_inflight
from genfleet.workers.observe.engine_state import enforced_cap
from genfleet.workers.observe.sampler import make_sampler
from genfleet.workers.tune.measure import EngineReader, Load, judge, measure
from genfleet.workers.tune.sweep import (
    AUTO_CONCURRENCY,
    Options,
    Point,
    TuneConfig,
    best,
    headers,
    markdown_table,
    settings_file_text,
    table_rows,
)

log = logging.getLogger("genfleet.tune")
console = Console(stderr=True)
out = Console()

BUILTIN_PROMPTS = (
    "Explain how a hash map handles collisions, with a short example.",
    "Write a haiku about a lighthouse in winter.",
    "Summarise the causes of the French Revolution in five bullet points.",
    "What is the derivative of x^3 * sin(x)? Show the steps.",
    "Write a Python function that merges two sorted lists.",
    "Describe the water cycle to a ten-year-old.",
    "Compare TCP and UDP for a multiplayer game.",
    "Draft a polite email asking to move a meeting to Thursday.",
    "Prove that the square root of 2 is irrational.",
    "List five uses of a Raspberry Pi at home and what each needs.",
    "Translate 'The early bird catches the worm' into French and German, and explain it.",
    "Why does ice float on water?",
    "Give a recipe for a vegetarian lentil soup for four people.",
    "Explain the difference between a process and a thread.",
    "Write a short story opening set on a generation ship.",
    "How do vaccines train the immune system?",
    "What are the trade-offs of microservices versus a monolith?",
    "Solve: a train leaves at 9:00 at 80 km/h; another at 10:00 at 100 km/h. When does the "
    "second catch up?",
    "Explain gradient descent and the role of the learning rate.",
    "Write a SQL query returning the three best-selling products per month.",
    "What makes a good unit test? Give an example in any language.",
    "Describe how a bill becomes law in a parliamentary system.",
    "Plan a three-day trip to Lisbon on a modest budget.",
    "Explain public-key cryptography with an analogy, then precisely.",
)


def load_prompts(dataset: str | None, settings: Settings, limit: int = 5000) -> list[PromptRecord]:
    """Prompts from the user's dataset (rejects skipped), else the built-in set."""
    if dataset is None:
        return [
            PromptRecord(f"tune-{i}", [{"role": "user", "content": text}])
            for i, text in enumerate(BUILTIN_PROMPTS)
        ]
    from genfleet.common.readers import ReaderOptions, read_source

    options = ReaderOptions(system_prompt=settings.system_prompt, limit=limit)
    prompts = [item for item in read_source(dataset, options) if isinstance(item, PromptRecord)]
    if not prompts:
        raise GenfleetError(f"{dataset}: no usable prompt")
    return prompts


def start_engine(settings: Settings, config: TuneConfig) -> tuple[EngineSupervisor, Settings]:
    """The engine of one configuration, started through the worker's supervisor, with the
    engine plan the worker would launch it with (its cap pinned where the point says)."""
    arch = None
    if settings.engine_kind == "sglang":
        from genfleet.workers.engine.preflight import preflight

        # This point's MTP choice: a checkpoint without MTP weights is refused for an MTP point.
        arch = preflight(settings.model_copy(update={"mtp": config.mtp})).arch
    each, plan = point_settings(settings, config, arch)
    port = pick_port(each.engine_host, each.port)
    launch = engine_launch(each, port, arch=arch, plan=plan)
    assert launch is not None  # external engines are refused in tune_options
    log_dir = Path(each.log_dir) if each.log_dir else private_dir("logs")
    label = config.label.replace(":", "-")
    supervisor = EngineSupervisor(
        launch,
        gpus=each.gpus,
        log_path=log_dir / f"tune-{label}-{port}.log",
        startup_timeout_s=each.startup_timeout_s,
        stop_timeout_s=each.stop_timeout_s,
        restart_budget=0,
    )
    try:
        supervisor.start()
    except BaseException:
        supervisor.stop()  # an interrupt during the start leaves no engine behind either
        raise
    return supervisor, each


def point_settings(
    settings: Settings, config: TuneConfig, arch: str | None
) -> tuple[Settings, EnginePlan | None]:
    """The worker settings and engine plan of one point: its MTP choice, its cap (pinned, or
    the plan's times its scale), or the radix cache kept with SGLang's own state/KV split
    (`--mamba-full-memory-ratio` where the point names one). ConfigError / GenfleetError
    before any engine starts where the point cannot be made (no plan to sweep)."""
    update: dict[str, Any] = {"mtp": config.mtp, "speculative_adaptive": config.adaptive}
    if config.max_running_requests is not None:
        update["max_running_requests"] = config.max_running_requests
    each = with_engine_key(settings.model_copy(update=update))
    if config.radix or config.plan_scale is not None:
        _, plan = planned(each, arch)
        if plan is None or not plan.planned:
            why = plan.notes[0] if plan is not None and plan.notes else "--no-engine-plan"
            raise GenfleetError(f"MTP {config.label}: no engine plan to sweep ({why})")
        if config.radix:
            extra = each.engine_extra_args
            if config.mamba_ratio is not None:
                extra = f"{extra} --mamba-full-memory-ratio {config.mamba_ratio:g}".strip()
            each = each.model_copy(
                update={
                    "mamba_cache_strategy": each.mamba_cache_strategy or "extra_buffer",
                    "engine_extra_args": extra,
                    "mem_fraction_static": each.mem_fraction_static or PLAN_MEM_FRACTION,
                }
            )
        else:
            cap = config.planned_cap(plan.max_running_requests)
            each = each.model_copy(update={"max_running_requests": cap})
    return planned(each, arch)


def effective_cap(settings: Settings) -> int | None:
    """The running-batch cap the engine runs with, where genfleet sets one."""
    if settings.engine_kind not in {"sglang", "emulator"}:
        return None
    return settings.max_running_requests or DEFAULT_MAX_RUNNING_REQUESTS


def run_config(
    config: TuneConfig,
    options: Options,
    settings: Settings,
    prompts: Iterator[PromptRecord],
    bar: Bar,
    points: list[Point],
) -> None:
    """Start one configuration's engine, warm it up, measure every concurrency, stop it.
    Each point joins `points` as soon as it is measured, so an interrupted sweep keeps it."""
    bar.show(f"MTP {config.label}: starting the engine")
    supervisor, each = start_engine(settings, config)
    try:
        stop_if_interrupted()
        measure_engine(config, options, supervisor, each, prompts, bar, points)
    finally:
        supervisor.stop()


def measure_engine(
    config: TuneConfig,
    options: Options,
    supervisor: EngineSupervisor,
    each: Settings,
    prompts: Iterator[PromptRecord],
    bar: Bar,
    points: list[Point],
) -> None:
    """Warm up the configuration's running engine and measure every concurrency on it."""
    info = supervisor.server_info
    # what the engine enforces when it says so (SGLang may hold fewer than configured)
    cap = enforced_cap(info) if effective_cap(each) is not None else None
    cap = cap or effective_cap(each)
    choice = choose(each, checkpoint_arch(each.model))
    model = str(each.served_model_name or info.get("served_model_name") or each.model or "default")
    params = GenerationParams(
        max_tokens=each.max_tokens,
        temperature=each.temperature,
        top_p=each.top_p,
        thinking=each.thinking,
    )
    sampler = make_sampler(each, supervisor.base_url)
    if not sampler.available:
        console.print(f"[yellow]no GPU readings:[/] {sampler.reason}", highlight=False)
    reader = EngineReader(supervisor, each)
    try:
        # `auto`: what a worker keeps in flight for the cap this engine enforces.
        sweep = [
            default_max_inflight(cap) if c == AUTO_CONCURRENCY else c for c in options.concurrency
        ]
        for concurrency in [0, *sweep]:
            stop_if_interrupted()
            warmup = concurrency == 0
            lanes = min(8, max(sweep)) if warmup else concurrency
            seconds = options.warmup_s if warmup else options.duration_s
            if seconds <= 0:
                continue
            what = f"MTP {config.label} " + ("warming up" if warmup else f"C={concurrency}")
            client = EngineClient(
                supervisor.base_url,
                model=model,
                api_key=supervisor.launch.api_key,
                timeout_s=each.request_timeout_s,
                max_connections=lanes + 8,
                thinking=ThinkingSwitch(choice.thinking_key, choice.thinking_default),
            )
            ramp_s = 0.0 if warmup else options.ramp_s
            load = Load(client, prompts, params, lanes, seconds, ramp_s, options.drain_s)
            live, window = measure(load, sampler, reader, bar.show, what)
            if not warmup:
                points.append(judge(config, concurrency, cap, live, window, each))
            bar.step_done(seconds + ramp_s)
    finally:
        reader.close()
        close = getattr(sampler, "close", None)
        if close is not None:
            close()


class Bar:
    """The progress bar: measured seconds done over the sweep's planned seconds."""

    def __init__(self, progress: Progress, total_s: float) -> None:
        self.progress = progress
        self.task = progress.add_task("tune", total=total_s)
        self.done_s = 0.0

    def show(self, description: str, into_step_s: float = 0.0) -> None:
        self.progress.update(
            self.task, description=description, completed=self.done_s + into_step_s
        )

    def step_done(self, seconds: float) -> None:
        self.done_s += seconds
        self.progress.update(self.task, completed=self.done_s)


def show(
    points: list[Point],
    to_stderr: bool = False,
    gpu_hour_cost: float | None = None,
    gpus: int = 1,
) -> None:
    """Print the table; a pipe or a log file gets it 160 columns wide, not rich's 80. With
    `--json` stdout holds the JSON alone, and the table goes to stderr. With a GPU-hour price,
    a cost-per-million-tokens column."""
    table = Table(title="genfleet tune", header_style="bold")
    for header in headers(gpu_hour_cost):
        table.add_column(header, justify="right" if header not in {"MTP", "verdict"} else "left")
    for row in table_rows(points, gpu_hour_cost, gpus):
        table.add_row(*row)
    if to_stderr:
        (console if console.is_terminal else Console(width=160, stderr=True)).print(table)
        return
    (out if out.is_terminal else Console(width=160)).print(table)


def run_tune(options: Options, settings: Settings) -> None:
    """The sweep of `genfleet tune` (see `genfleet.workers.cli.tune` for its flags)."""
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    try:
        prompts = load_prompts(options.dataset, settings)
    except (ValueError, GenfleetError) as exc:
        fail(str(exc).replace("\n", " "))
    kind = settings.engine_kind
    console.print(
        f"tune: engine {kind} {settings.model or ''}; MTP "
        f"{', '.join(c.label for c in options.configs)}; C={options.concurrency}; "
        f"{options.duration_s:g} s per point after {options.warmup_s:g} s warm-up; "
        f"{len(prompts)} prompts",
        highlight=False,
    )
    if kind == "emulator":
        console.print("[bold yellow]ENGINE: the genfleet emulator[/]: synthetic figures")
    total = len(options.configs) * (
        options.warmup_s + options.duration_s * len(options.concurrency)
    )
    points: list[Point] = []
    cycle = itertools.cycle(prompts)
    # `timeout`, a scheduler's stop and Ctrl-C alike: each engine is stopped on the way out
    # and the points measured so far are still shown and written.
    signal.signal(signal.SIGTERM, _interrupt)
    progress = Progress(
        TextColumn("{task.description}"),
        BarColumn(),
        TextColumn("{task.percentage:>3.0f}%"),
        TimeElapsedColumn(),
        console=console,
    )
    try:
        with progress:
            bar = Bar(progress, total)
            for config in options.configs:
                run_config(config, options, settings, cycle, bar, points)
    except GenfleetError as exc:
        fail(f"{exc}".splitlines()[0])
    except KeyboardInterrupt:
        console.print(f"interrupted: {len(points)} point(s) measured before it")
        if points:
            show(points, options.json_stdout, settings.gpu_hour_cost, settings.tp_size)
            report(points, options, settings, interrupted=True)
        raise typer.Exit(130) from None
    show(points, options.json_stdout, settings.gpu_hour_cost, settings.tp_size)
    report(points, options, settings)


# The signals the sweep was sent (SIGTERM), once its handler is installed.
_INTERRUPTS: list[int] = []


def _interrupt(signum: int, frame: object) -> None:
    """SIGTERM: raise where it lands, and note it. Where it lands can swallow it: a handler
    run inside an at-fork hook or a finalizer (Popen's fork, logging's lock) is "ignored",
    and the sweep went on to its end with exit 0. `stop_if_interrupted`, between an engine's
    start and each point, stops it there. A point's own requests are cancelled at their next
    await instead (`tune.measure`)."""
    _INTERRUPTS.append(signum)
    raise KeyboardInterrupt


def stop_if_interrupted() -> None:
    """Raise KeyboardInterrupt, at a place that cannot swallow it, if the sweep was sent
    SIGTERM (`_interrupt`)."""
    if _INTERRUPTS:
        raise KeyboardInterrupt


def report(
    points: list[Point], options: Options, settings: Settings, interrupted: bool = False
) -> None:
    """Write the chosen point as a settings file and, if asked, every point as JSON.
    `interrupted`: the sweep stopped before its last point. The JSON keeps what was measured
    and says so; no settings file is written, since the best of part of a sweep is not the
    sweep's choice."""
    fastest, frugal = best(points)
    chosen = frugal if options.pick == "energy" else fastest
    if options.json_path is not None or options.json_stdout:
        data = {
            "engine": settings.engine_kind,
            "model": settings.model,
            "engine_command": settings.engine_command,
            "duration_s": options.duration_s,
            "warmup_s": options.warmup_s,
            "interrupted": interrupted,
            "points": [p.to_json() for p in points],
            "best_tokens_per_s": fastest.to_json() if fastest else None,
            "best_j_per_token": frugal.to_json() if frugal else None,
            "gpu_hour_cost": settings.gpu_hour_cost,
            "markdown": markdown_table(points, settings.gpu_hour_cost, settings.tp_size),
        }
        if options.json_path is not None:
            options.json_path.write_bytes(orjson.dumps(data, option=orjson.OPT_INDENT_2))
        if options.json_stdout:
            sys.stdout.write(orjson.dumps(data).decode() + "\n")
    if interrupted:
        console.print(f"{options.out} not written: the sweep did not finish", highlight=False)
        return
    if chosen is None:
        fail("no point produced tokens without errors: nothing to write", 1)
    options.out.write_text(
        settings_file_text(
            chosen, engine=settings.engine_kind, model=settings.model, objective=options.pick
        )
    )
    console.print(
        f"best by tok/s: MTP {fastest.config if fastest else '-'} C="
        f"{fastest.concurrency if fastest else '-'}; best by J/token: MTP "
        f"{frugal.config if frugal else '-'} C={frugal.concurrency if frugal else '-'}; "
        f"wrote {options.out} (use: genfleet worker --settings-file {options.out})",
        highlight=False,
    )
