"""The GPU side of `genfleet`: worker, control, preflight, top, tune and flower.

`genfleet` registers these commands (loading this module only when one runs or `--help` lists
them) and `python -m genfleet.workers` runs them alone; both parse with the same options, every
setting a flag of the same name. This module imports nothing heavy: Celery, the engine and NVML
are imported inside the commands.
"""

from __future__ import annotations

import os
import signal
import socket
import sys
from pathlib import Path
from typing import Annotated, Any

import orjson
import typer

from genfleet.common.errors import GenfleetError
from genfleet.common.flags import fail, settings_from, with_settings
from genfleet.common.help import HelpCommand
from genfleet.common.redis_conn import connect
from genfleet.common.routing import worker_queue
from genfleet.common.settings import Settings
from genfleet.workers.tune.sweep import Options, tune_options

GPU_PANEL = "GPU node"

app = typer.Typer(
    name="genfleet",
    help="The GPU side of genfleet: workers with their engines, the control worker, checks.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)

Hostname = Annotated[
    str | None, typer.Option("--hostname", help="Celery node name (name@host)", show_default=False)
]
JsonFlag = Annotated[bool, typer.Option("--json", help="one JSON object on stdout")]


def gpu_groups(gpus: str | None, tp_size: int) -> list[str | None]:
    """`0,1,2,3` with tp 2 → ["0,1", "2,3"]; no --gpus → one group that sees what it sees."""
    if not gpus:
        return [None]
    ids = [g.strip() for g in gpus.split(",") if g.strip()]
    if len(ids) % tp_size:
        fail(f"--gpus has {len(ids)} GPUs, not a multiple of --tp-size {tp_size}")
    return [",".join(ids[i : i + tp_size]) for i in range(0, len(ids), tp_size)]


def group_settings(settings: Settings, group: str | None, index: int, count: int) -> Settings:
    """Settings of the index-th worker: its GPUs and its own engine port."""
    port = settings.port + index * 10 if count > 1 else settings.port
    return settings.model_copy(update={"gpus": group, "port": port})


@with_settings(exclude={"role"})
def worker(
    settings: Settings,
    print_engine_command: Annotated[
        bool,
        typer.Option("--print-engine-command", help="print what would be launched, launch nothing"),
    ] = False,
    hostname: Hostname = None,
    worker_index: Annotated[int | None, typer.Option(hidden=True)] = None,
) -> None:
    """Start GPU workers on this node: one Celery worker + engine per GPU group.

    `genfleet worker --gpus 0,1,2,3 --tp-size 2 --model PATH`, plus any setting below.
    """
    settings = settings.model_copy(update={"role": "gpu"})
    groups = gpu_groups(settings.gpus, settings.tp_size)
    if settings.engine is None and not settings.model:
        print(emulator_banner(worker_queue(settings)), file=sys.stderr, flush=True)
    if print_engine_command:
        from genfleet.workers.engine.kinds import print_engine_command as engine_command

        for i, group in enumerate(groups):
            each = group_settings(settings, group, i, len(groups))
            prefix = f"CUDA_VISIBLE_DEVICES={group} " if group else ""
            print(prefix + engine_command(each, each.port))
        return
    if len(groups) > 1 and worker_index is None:
        run_group_workers(settings, groups, hostname)
        return
    host = socket.gethostname()
    index = worker_index
    name = hostname or (f"gpu{index}@{host}" if index is not None else f"gpu@{host}")
    concurrency = str(settings.worker_concurrency)
    queue = worker_queue(settings)  # its model's queue: it takes no other model's orders
    run_celery(settings, ["--queues", queue, "--concurrency", concurrency], name)


def emulator_banner(queue: str) -> str:
    """What a worker started with no model and no `--engine` says first, on stderr: that it
    runs the emulator (synthetic answers) and takes only the emulator's queue, never a
    model's, so a forgotten `--model` cannot pass for a GPU worker."""
    line = "!" * 78
    return (
        f"{line}\n"
        f"  genfleet worker: no --model and no --engine given: running the ENGINE EMULATOR.\n"
        f"  Its answers are synthetic. It consumes only {queue}, never a model's queue.\n"
        f"  For a real engine: genfleet worker --model PATH (or --engine external|command).\n"
        f"{line}"
    )


def run_group_workers(settings: Settings, groups: list[str | None], hostname: str | None) -> None:
    """One child worker per GPU group, its settings in its environment; signals are
    forwarded; a child that dies unasked is restarted (`--worker-restart-budget` times each,
    with backoff) and reported; exit when they all exit."""
    from genfleet.workers.process.children import Child, ChildWorkers, report_restart

    require_redis(settings, "genfleet worker")
    children = []
    for i, group in enumerate(groups):
        each = group_settings(settings, group, i, len(groups))
        argv = [sys.executable, "-m", "genfleet.workers", "worker", "--worker-index", str(i)]
        if hostname:  # name@host → name0@host, name1@host, ...
            name, _, domain = hostname.partition("@")
            argv += ["--hostname", f"{name}{i}@{domain or socket.gethostname()}"]
        env = {**os.environ, **each.child_env()}
        children.append(Child(argv, env, f"child worker {i} (GPUs {group})"))
    pool = ChildWorkers(
        children,
        settings.worker_restart_budget,
        settings.restart_backoff_s,
        report=lambda child, code: report_restart(settings, child, code),
    )
    signal.signal(signal.SIGTERM, lambda signum, _frame: pool.signal(signum))
    signal.signal(signal.SIGINT, lambda signum, _frame: pool.signal(signum))
    raise typer.Exit(pool.run())


def require_redis(settings: Settings, who: str) -> None:
    """Before a worker, its children or Flower start: Celery and Flower would retry an
    unreachable broker for ever (control, Flower), log a traceback from the engine step
    (worker) or restart children that cannot start; exit 1 (nothing started), saying why."""
    try:
        connect(settings).close()
    except GenfleetError as exc:
        fail(f"{who} did not start: {exc}", code=1)


def run_celery(settings: Settings, args: list[str], hostname: str) -> None:
    """This process's Celery worker, configured with `settings` (handed over, not re-read)."""
    from genfleet.workers.app import app as celery_app
    from genfleet.workers.app import configure, startup_failures

    require_redis(settings, hostname)
    configure(settings)
    # No gossip: it would have every worker consume every other worker's heartbeats and task
    # events (O(workers²) messages); the events are still sent, for Flower and `top`.
    flags = ["--hostname", hostname, "--loglevel", "INFO", "--task-events"]
    flags += ["--without-mingle", "--without-gossip"]
    # `app.start`, not `worker_main`, which drops the exit code: a worker whose engine step
    # failed (a checkpoint preflight refused) must not exit 0, or a supervisor sees success.
    code = celery_app.start(["worker", *args, *flags])
    if startup_failures:
        fail(f"worker {hostname} did not start: {startup_failures[-1]}", code=1)
    if code:
        raise typer.Exit(code)


@with_settings(exclude={"role"})
def control(settings: Settings, hostname: Hostname = None) -> None:
    """Start the one control worker: beat (power-watch, lease reaper) with no engine."""
    from genfleet.common.private import private_dir

    settings = settings.model_copy(update={"role": "control"})
    name = hostname or f"control@{socket.gethostname()}"
    # Beat's schedule is a shelve (pickle) file: loading one someone else wrote runs their
    # code as this worker, so it lives in this user's own 0700 directory (made here, so beat
    # can open it), never in /tmp or a shared --log-dir.
    schedule = private_dir("beat") / f"{name.replace('/', '_')}.schedule"
    args = ["--beat", "--schedule", str(schedule), "--queues", "control", "--concurrency", "2"]
    run_celery(settings, args, name)


@with_settings()
def preflight(settings: Settings, json_out: JsonFlag = False) -> None:
    """Check a checkpoint before any GPU time: config, MTP weights. Exit 0 if it would start."""
    if not settings.model:
        fail("preflight needs --model PATH")
    from genfleet.workers.engine.preflight import preflight as check

    try:
        report = check(settings)
    except GenfleetError as exc:
        if json_out:
            print(orjson.dumps({"ok": False, "error": str(exc)}).decode())
        fail(str(exc), 1)
    if json_out:
        print(orjson.dumps({"ok": True, **report.to_json()}).decode())
        return
    print(f"ok: {settings.model} would start ({report.arch}; MTP {report.mtp_layout or 'off'})")
    for warning in report.warnings:
        print(f"warning: {warning}")


@with_settings()
def top(
    settings: Settings,
    once: Annotated[bool, typer.Option("--once", help="print one table and exit")] = False,
    json_out: JsonFlag = False,
) -> None:
    """A live table, one row per GPU: power / limit, tok/s, in-flight, accept length, verdict.

    `--once --json` prints one JSON object per GPU.
    """
    from genfleet.workers.app import configure
    from genfleet.workers.observe.top import main as top_main

    configure(settings)
    try:
        top_main(settings, once, json_out)
    except KeyboardInterrupt:
        pass


@with_settings(exclude={"port"})
def flower(
    settings: Settings,
    port: Annotated[int, typer.Option("--port", help="Flower's port")] = 5555,
    address: Annotated[
        str, typer.Option(help="Flower's address; off loopback it needs FLOWER_BASIC_AUTH")
    ] = "127.0.0.1",
    db: Annotated[
        str | None,
        typer.Option(
            help="Flower's state, kept across restarts (a pickle Flower loads: a place of "
            "your own)",
            show_default="flower.db in ~/.local/state/genfleet-UID/flower",
        ),
    ] = None,
) -> None:
    """Flower for this fleet: task results as lines, basic auth from FLOWER_BASIC_AUTH.

    Its Tasks page shows each batch and power-watch round as a line; state persists in --db.
    """
    from genfleet.workers.observe.flower import launch

    require_redis(settings, "flower")
    launch(settings, port, address, db)


@with_settings(exclude={"mtp"})
def tune(
    settings: Settings,
    concurrency: Annotated[
        str | None,
        typer.Option(
            help="requests kept in flight, one window each; auto: what a worker keeps for "
            "the cap the engine enforces",
            show_default="auto for a sweep of the engine plan, else 1,4,16,64,128",
        ),
    ] = None,
    mtp: Annotated[
        str | None,
        typer.Option(
            "--mtp",
            help="engine configurations: on, adaptive (SGLang 0.5.12+), off; NAME:N pins "
            "--max-running-requests N; NAME:plan runs the engine plan's cap, NAME:plan*F F "
            "times it (each a fresh engine with the plan's memory flags); NAME:radix keeps the "
            "radix cache and SGLang's own state/KV split, NAME:radix/R with "
            "--mamba-full-memory-ratio R",
            show_default="off:plan*0.75,off:plan,off:plan*1.25,on:plan for SGLang with the "
            "engine plan; on,on:48,off for the emulator; off for --engine command",
        ),
    ] = None,
    duration_s: Annotated[float, typer.Option(help="measured seconds per point")] = 30.0,
    warmup_s: Annotated[float, typer.Option(help="warm-up per configuration")] = 5.0,
    ramp_s: Annotated[float, typer.Option(help="load before each window opens")] = 5.0,
    drain_s: Annotated[
        float,
        typer.Option(
            help="after a window, how long its requests may run on; an engine that streams "
            "no token counts is read from answers that end by then"
        ),
    ] = 10.0,
    dataset: Annotated[str | None, typer.Option(help="prompts (any enqueue format)")] = None,
    out: Annotated[
        Path, typer.Option("--settings-out", help="settings file of the chosen point")
    ] = Path("tuned.env"),
    json_path: Annotated[
        Path | None,
        typer.Option("--json-out", help="every point as a JSON file", show_default=False),
    ] = None,
    json_stdout: Annotated[
        bool, typer.Option("--json", help="every point as JSON on stdout (the table on stderr)")
    ] = False,
    pick: Annotated[
        str, typer.Option(help="what the settings file optimises: throughput or energy")
    ] = "throughput",
) -> None:
    """Sweep the engine plan (cap, MTP) or concurrency x MTP; print tok/s, watts, J/token;
    write the best as settings.

    `genfleet tune --model PATH` sweeps the plan's cap at the run's --max-tokens;
    `genfleet tune --model PATH --concurrency 1,4,16 --mtp on,off`, plus any setting below.
    """
    from genfleet.workers.tune.command import run_tune

    try:
        options = tune_options(
            settings,
            concurrency=concurrency,
            mtp=mtp,
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
    except ValueError as exc:
        fail(str(exc))
    run_tune(options, settings)


# Every GPU-side command, registered explicitly; `genfleet` lists the same ones.
app.command(rich_help_panel=GPU_PANEL, cls=HelpCommand)(worker)
app.command(rich_help_panel=GPU_PANEL, cls=HelpCommand)(control)
app.command(rich_help_panel=GPU_PANEL, cls=HelpCommand)(preflight)
app.command(rich_help_panel=GPU_PANEL, cls=HelpCommand)(top)
app.command(rich_help_panel=GPU_PANEL, cls=HelpCommand)(tune)
app.command(rich_help_panel=GPU_PANEL, cls=HelpCommand)(flower)
COMMANDS = ("worker", "control", "preflight", "top", "tune", "flower")


def parse(command: str, args: list[str]) -> dict[str, Any]:
    """The values a command's parser gives for `args` (nothing runs): click's errors as they
    are, for tests and checks of command lines written elsewhere (compose files)."""
    group: Any = typer.main.get_command(app)
    with group.make_context("genfleet", [command]) as root:
        found = group.get_command(root, command)
        with found.make_context(command, list(args), parent=root) as ctx:
            return dict(ctx.params)


def parse_tune_args(args: list[str]) -> tuple[Options, Settings]:
    """`genfleet tune ARGS` parsed, as the command would see them; raises ValueError."""
    values = parse("tune", args)
    taken: frozenset[str] = tune.settings_params  # type: ignore[attr-defined]
    settings = settings_from({k: values.pop(k) for k in taken})
    return tune_options(settings, **values), settings
