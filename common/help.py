"""A command's `--help`, readable at 80 columns: every flag name whole, in its panel.

Typer's own layout puts a flag, its `--no-` twin, its type and its help in four columns of one
table; with ~100 settings (flags up to 30 characters, variables up to 40) an 80-column
terminal squeezes every column and cuts the flag names with "…" (`--served-model-n…`). Here
each flag is one line of a two-column table: the names column is as wide as the longest flag
name (the `--no-` twin on the line below), the help column takes the rest and folds a word
longer than itself (a `GENFLEET_…` variable) instead of cutting it. Panels keep typer's titles
and order (`rich_help_panel`), so `--help` reads as it did on a wide terminal.
"""

from __future__ import annotations

import inspect
from typing import Any

from rich.console import Console, Group
from rich.padding import Padding
from rich.panel import Panel
from rich.table import Table
from rich.text import Text
from typer.core import TyperCommand

OPTIONS, ARGUMENTS = "Options", "Arguments"
TYPE_ROOM = 8  # "<float>" and a space


class HelpCommand(TyperCommand):
    """A typer command whose `--help` is `render_help`'s (when rich is there to draw it)."""

    def format_help(self, ctx: Any, formatter: Any) -> None:
        if self.rich_markup_mode is None:
            super().format_help(ctx, formatter)
            return
        Console(highlight=False).print(render_help(self, ctx))


def render_help(command: Any, ctx: Any) -> Group:
    """Usage, the command's text, then one panel per group of parameters."""
    usage = " ".join([ctx.command_path, *command.collect_usage_pieces(ctx)])
    parts: list[Any] = [Padding(Text(f"Usage: {usage}"), (1, 1))]
    if command.help:
        text = inspect.cleandoc(command.help).split("\f")[0]
        paragraphs = [" ".join(p.split("\n")) for p in text.split("\n\n")]
        parts.extend(Padding(Text(p), (0, 1, 1, 1)) for p in paragraphs)
    for title, rows in panels(command, ctx).items():
        table = _table(rows, names_width(rows))
        parts.append(Panel(table, title=title, title_align="left", border_style="dim"))
    if command.epilog:
        parts.append(Text(inspect.cleandoc(command.epilog)))
    return Group(*parts)


def panels(command: Any, ctx: Any) -> dict[str, list[tuple[list[str], str]]]:
    """Each panel's rows, in the order panels first appear: (name lines, help)."""
    found: dict[str, list[tuple[list[str], str]]] = {}
    for param in command.get_params(ctx):
        if getattr(param, "hidden", False):
            continue
        argument = param.param_type_name == "argument"
        default_panel = ARGUMENTS if argument else OPTIONS
        title = getattr(param, "rich_help_panel", None) or default_panel
        found.setdefault(title, []).append((names(param, argument, ctx), describe(param)))
    return found


def names(param: Any, argument: bool, ctx: Any) -> list[str]:
    """The lines of a parameter's names column: each flag on its own line, the type after the
    first one."""
    kind = type_name(param, ctx)
    if argument:
        return [f"{'* ' if param.required else ''}{param.name} {kind}".rstrip()]
    flags: list[str] = [*param.opts, *param.secondary_opts]
    mark = "* " if param.required else ""
    return [f"{mark}{flags[0]} {kind}".rstrip(), *flags[1:]]


def type_name(param: Any, ctx: Any) -> str:
    """The parameter's type as typer names it (`<int>`, `<a|b>`), or click's name for it;
    nothing for a flag that takes no value (`--mtp`, `--help`)."""
    if getattr(param, "is_flag", False) or getattr(param, "count", False):
        return ""
    shown = getattr(param, "display_type_rich", None)
    if shown is not None:
        return str(shown(ctx=ctx) or "")
    kind = getattr(param, "type", None)
    choices = getattr(kind, "choices", None)
    if choices:
        return "<" + "|".join(map(str, choices)) + ">"
    return f"<{getattr(kind, 'name', 'value')}>"


def describe(param: Any) -> str:
    """The help of a parameter, with its default and whether it is required."""
    text = getattr(param, "help", None) or ""
    shown = getattr(param, "show_default", None)
    if isinstance(shown, str) and shown:
        text += f" [default: {shown}]"
    elif shown and param.default not in (None, False, ()):
        default = param.default
        if getattr(param, "is_flag", False) and param.secondary_opts:
            default = (param.opts if default else param.secondary_opts)[0].lstrip("-")
        text += f" [default: {default}]"
    if param.required:
        text += " [required]"
    return text.strip()


def names_width(rows: list[tuple[list[str], str]]) -> int:
    """A panel's names column width: its longest flag name, and its type on the same line when
    that costs at most TYPE_ROOM more (else the type wraps below). Each panel has its own, so
    one long name (the emulator's) narrows no other panel's help."""
    lines = [line for names_of, _ in rows for line in names_of]
    flags = max(len(line.split(" <")[0]) for line in lines)
    return min(max(len(line) for line in lines), flags + TYPE_ROOM)


def _table(rows: list[tuple[list[str], str]], width: int) -> Table:
    table = Table(box=None, show_header=False, expand=True, padding=(0, 1), pad_edge=False)
    table.add_column(width=width, overflow="fold")
    table.add_column(ratio=1, overflow="fold")
    for lines, help_text in rows:
        table.add_row(Text("\n".join(lines)), Text(help_text))
    return table
