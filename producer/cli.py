"""`genfleet`: the command line. Every setting is also a flag of the same name.

Producer commands (enqueue, status, export, report, retry, run) run here; GPU-side commands
(worker, control, preflight, tune) run in `python -m genfleet.workers`, so a producer-only install
never imports the worker stack.
"""

from __future__ import annotations

import os
import sys
from typing import NoReturn

import orjson
import typer

from genfleet.common.errors import GenfleetError
from genfleet.producer import commands, local_run
from genfleet.producer.console import PASS_THROUGH, Json, build_settings, console, out

app = typer.Typer(
    name="genfleet",
    help="Bulk LLM generation on a GPU fleet: Redis → Celery workers → SGLang (MTP on) → S3.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)


def _forward(command: str, args: list[str]) -> NoReturn:
    """Hand a GPU-side command to `python -m genfleet.workers` (same flags, same environment)."""
    argv = [sys.executable, "-m", "genfleet.workers", command, *args]
    os.execv(sys.executable, argv)


@app.command(context_settings={**PASS_THROUGH, "help_option_names": []}, add_help_option=False)
def worker(ctx: typer.Context) -> None:
    """Start GPU workers on this node: one Celery worker + engine per GPU group.

    `genfleet worker --gpus 0,1,2,3 --tp-size 2 [--model PATH] [--no-mtp] [any setting]`;
    `--print-engine-command` prints what would be launched, without launching.
    """
    _forward("worker", list(ctx.args))


@app.command(context_settings={**PASS_THROUGH, "help_option_names": []}, add_help_option=False)
def control(ctx: typer.Context) -> None:
    """Start the one control worker: beat (power-watch, lease reaper) with no engine."""
    _forward("control", list(ctx.args))


@app.command(context_settings={**PASS_THROUGH, "help_option_names": []}, add_help_option=False)
def preflight(ctx: typer.Context) -> None:
    """Check a checkpoint before any GPU time: config, MTP weights. Exit 0 if it would start."""
    _forward("preflight", list(ctx.args))


@app.command(context_settings={**PASS_THROUGH, "help_option_names": []}, add_help_option=False)
def tune(ctx: typer.Context) -> None:
    """Sweep concurrency x MTP on an engine; print tok/s, watts, J/token; write the best."""
    _forward("tune", list(ctx.args))


@app.command(context_settings={**PASS_THROUGH, "help_option_names": []}, add_help_option=False)
def top(ctx: typer.Context) -> None:
    """A live table, one row per GPU: power / limit, tok/s, in-flight, accept length, verdict.

    `--once --json` prints one JSON object per GPU.
    """
    _forward("top", list(ctx.args))


@app.command("settings")
def show_settings(json_out: Json = False) -> None:
    """Every setting with its flag, environment variable and current value (secrets masked)."""
    settings = build_settings()
    data = settings.redacted()
    if json_out:
        out.print_json(orjson.dumps(data, default=str).decode())
        return
    for name, value in data.items():
        flag = "--" + name.replace("_", "-")
        out.print(f"{flag:36} GENFLEET_{name.upper():40} {value!r}", highlight=False)


# Every command is registered here, explicitly: importing a module registers nothing.
app.command(context_settings=PASS_THROUGH)(commands.enqueue)
app.command()(commands.status)
app.command()(commands.retry)
app.command()(commands.export)
app.command()(commands.report)
app.command()(commands.findings)
app.command("run", context_settings=PASS_THROUGH)(local_run.run_command)


def main() -> None:
    """Console-script entry point: clear errors, no tracebacks for expected failures."""
    try:
        app()
    except GenfleetError as exc:
        console.print(f"[bold red]error:[/] {exc}", highlight=False)
        sys.exit(2)
