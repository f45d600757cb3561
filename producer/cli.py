"""`genfleet`: the command line, one root app. Every setting is also a flag of the same name.

Producer commands (enqueue, status, export, report, retry, findings, run, settings) live in the
producer. The GPU side's commands (worker, control, preflight, top, tune, flower) live in
`genfleet.workers.cli`, loaded only when one of them runs or `--help` lists them, so the
producer's own commands never import the worker stack.
"""

from __future__ import annotations

from typing import Any

import orjson
import typer
from typer.core import TyperGroup

from genfleet.common.errors import GenfleetError
from genfleet.common.flags import fail, with_settings
from genfleet.common.settings import DEFAULT_STORE, Settings, store_url
from genfleet.producer import commands, local_run
from genfleet.producer.console import Json, out
from genfleet.producer.runs import commands as run_commands

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


app = typer.Typer(
    name="genfleet",
    cls=RootGroup,
    help="Bulk LLM generation on a GPU fleet: Redis → Celery workers → SGLang (MTP on) → S3.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)


@with_settings()
def show_settings(settings: Settings, json_out: Json = False) -> None:
    """Every setting with its flag, environment variable and value (secrets masked).

    The values are what a command given the same environment and flags would run with; the
    store, unless set, is the embedded one of this user (DEFAULT_STORE), whatever the
    current directory.
    """
    data: dict[str, Any] = settings.redacted()
    if json_out:
        out.print_json(orjson.dumps(data, default=str).decode())
        return
    default = f"{DEFAULT_STORE} = {store_url(DEFAULT_STORE)}"
    out.print(f"store: {settings.store} (default: {default})", highlight=False, soft_wrap=True)
    for name, value in data.items():
        flag = "--" + name.replace("_", "-")
        line = f"{flag:36} GENFLEET_{name.upper():40} {value!r}"
        out.print(line, highlight=False, soft_wrap=True)


# Every command is registered here, explicitly: importing a module registers nothing.
app.command()(commands.enqueue)
app.command()(commands.status)
app.command()(commands.retry)
app.command()(commands.export)
app.command()(commands.report)
app.command()(commands.findings)
app.command("run")(local_run.run_command)
app.command("settings")(show_settings)
app.command()(run_commands.runs)
app.command()(run_commands.cancel)
app.command()(run_commands.delete)


def main() -> None:
    """Console-script entry point: clear errors, no tracebacks for expected failures."""
    try:
        app()
    except GenfleetError as exc:
        fail(str(exc))
