"""`genfleet`: the command line. Every setting is also a flag of the same name.

Producer commands (enqueue, status, export, report, retry, run) run here; GPU-side commands
(worker, control, preflight, tune) run in `python -m workers`, so a producer-only install never
imports the worker stack.
"""

from __future__ import annotations

import os
import sys
from typing import Annotated, Any, NoReturn

import orjson
import typer
from rich.console import Console

from common.errors import GenfleetError
from common.settings import Settings, parse_setting_args

app = typer.Typer(
    name="genfleet",
    help="Bulk LLM generation on a GPU fleet: Redis → Celery workers → SGLang (MTP on) → S3.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)
console = Console(stderr=True)
out = Console()

PASS_THROUGH: dict[str, Any] = {
    "allow_extra_args": True,
    "ignore_unknown_options": True,
}

RedisUrl = Annotated[str | None, typer.Option("--redis-url", help="GENFLEET_REDIS_URL")]
StoreUrl = Annotated[
    str | None, typer.Option("--store", help="s3://bucket/prefix or file:///path (GENFLEET_STORE)")
]
S3Endpoint = Annotated[
    str | None, typer.Option("--s3-endpoint-url", help="GENFLEET_S3_ENDPOINT_URL (MinIO, ...)")
]
Json = Annotated[bool, typer.Option("--json", help="one JSON object on stdout")]


def fail(message: str, code: int = 2) -> NoReturn:
    console.print(f"[bold red]error:[/] {message}", highlight=False)
    raise typer.Exit(code)


def build_settings(extra: list[str] | None = None, **flags: Any) -> Settings:
    """Environment + defaults, overridden by the flags given (declared ones and `extra`)."""
    try:
        overrides = parse_setting_args(list(extra or []))
        overrides.update({k: v for k, v in flags.items() if v is not None})
        return Settings.from_overrides(overrides)
    except ValueError as exc:
        fail(str(exc).replace("\n", " "))


def _forward(command: str, args: list[str]) -> NoReturn:
    """Hand a GPU-side command to `python -m workers` (same flags, same environment)."""
    argv = [sys.executable, "-m", "workers", command, *args]
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


def main() -> None:
    """Console-script entry point: clear errors, no tracebacks for expected failures."""
    from producer import commands, local_run  # noqa: F401 - registers the commands

    try:
        app()
    except GenfleetError as exc:
        console.print(f"[bold red]error:[/] {exc}", highlight=False)
        sys.exit(2)
