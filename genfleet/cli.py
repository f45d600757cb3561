"""`genfleet`: the command line, one root app. Every setting is also a flag of the same name.

The one module above both sides: the producer's commands (`genfleet.producer.cli`) are
registered at import; the GPU side's (worker, control, preflight, top, tune, flower:
`genfleet.workers.cli`) are loaded only when one of them runs or `--help` lists them, so the
producer's own commands never import the worker stack.
"""

from __future__ import annotations

from typing import Any

import typer
from typer._click.exceptions import ClickException, UsageError
from typer.core import TyperGroup

from genfleet.common.errors import GenfleetError
from genfleet.common.flags import fail
from genfleet.producer import cli as producer_cli

# The GPU side's commands, by name: `genfleet.workers.cli` defines them.
GPU_COMMANDS = ("worker", "control", "preflight", "top", "tune", "flower")


class RootGroup(TyperGroup):
    """The root: the producer's commands registered below, the GPU side's loaded on use."""

    # Typed Any: the click these contexts and commands come from is typer's own (vendored).
    def list_commands(self, ctx: Any) -> list[str]:
        return [*super().list_commands(ctx), *GPU_COMMANDS]

    def get_command(self, ctx: Any, cmd_name: str) -> Any:
        if cmd_name not in GPU_COMMANDS:
            return super().get_command(ctx, cmd_name)
        from genfleet.workers.cli import app as gpu_app  # light: heavy imports are in commands

        group: Any = typer.main.get_command(gpu_app)
        return group.get_command(ctx, cmd_name)

    def make_context(self, *args: Any, **kwargs: Any) -> Any:
        try:
            return super().make_context(*args, **kwargs)
        except ClickException as exc:
            fail(usage_text(exc))

    def invoke(self, ctx: Any) -> Any:
        try:
            return super().invoke(ctx)
        except ClickException as exc:
            fail(usage_text(exc))


def usage_text(exc: ClickException) -> str:
    """A usage error (an unknown flag, a bad value, a missing argument) as the one `error:`
    line every other refusal is, with the help that lists what the command takes."""
    message = exc.format_message().rstrip(".")
    context = getattr(exc, "ctx", None) if isinstance(exc, UsageError) else None
    if context is not None:
        message += f" (see `{context.command_path} --help`)"
    return message


app = typer.Typer(
    name="genfleet",
    cls=RootGroup,
    help="Bulk LLM generation on a GPU fleet: Redis → Celery workers → SGLang (MTP on) → S3.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)
producer_cli.register(app)


def main() -> None:
    """Console-script entry point: clear errors, no tracebacks for expected failures."""
    try:
        app()
    except GenfleetError as exc:
        fail(str(exc))
