"""The producer's commands (enqueue, status, export, report, retry, findings, run, settings,
runs, cancel, delete), registered on the root `genfleet` app by `genfleet.cli`.

Registration is explicit (`register`): importing a module registers nothing.
"""

from __future__ import annotations

from typing import Any

import orjson
import typer

from genfleet.common.flags import with_settings
from genfleet.common.help import HelpCommand
from genfleet.common.settings import DEFAULT_STORE, Settings, store_url
from genfleet.producer import commands, local_run
from genfleet.producer.console import Json, out
from genfleet.producer.runs import commands as run_commands


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


def register(app: typer.Typer) -> None:
    """Add every producer command to `app`."""
    app.command(cls=HelpCommand)(commands.enqueue)
    app.command(cls=HelpCommand)(commands.status)
    app.command(cls=HelpCommand)(commands.retry)
    app.command(cls=HelpCommand)(commands.export)
    app.command(cls=HelpCommand)(commands.report)
    app.command(cls=HelpCommand)(commands.findings)
    app.command("run", cls=HelpCommand)(local_run.run_command)
    app.command("settings", cls=HelpCommand)(show_settings)
    app.command(cls=HelpCommand)(run_commands.runs)
    app.command(cls=HelpCommand)(run_commands.cancel)
    app.command(cls=HelpCommand)(run_commands.delete)
