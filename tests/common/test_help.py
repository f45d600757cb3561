"""`--help` at 80 columns: every flag name of every command whole, every line within the width
(`common/help.py`)."""

from __future__ import annotations

import re

import pytest
import typer
from typer.testing import CliRunner

from genfleet.cli import app
from genfleet.common.help import names_width

root = typer.main.get_command(app)
COMMANDS = list(root.list_commands(typer.Context(root)))  # type: ignore[attr-defined]


def flags_of(command: str) -> list[str]:
    group = typer.Context(root)
    found = root.get_command(group, command)  # type: ignore[attr-defined]
    params = found.get_params(typer.Context(found, parent=group, info_name=command))
    shown = [p for p in params if not getattr(p, "hidden", False)]
    return [flag for p in shown for flag in (*p.opts, *p.secondary_opts) if flag.startswith("--")]


@pytest.mark.parametrize("command", COMMANDS)
def test_at_80_columns_no_flag_name_is_cut(command: str) -> None:
    result = CliRunner().invoke(app, [command, "--help"], env={"COLUMNS": "80"})
    assert result.exit_code == 0, result.output
    lines = result.output.splitlines()
    assert all(len(line) <= 80 for line in lines), max(lines, key=len)
    flags = flags_of(command)
    assert len(flags) > 1
    for flag in flags:  # each on a line of its own making, whole
        assert re.search(rf"(?<![\w-]){re.escape(flag)}(?![\w-])", result.output), flag
    assert not re.search(r"--[\w-]*…", result.output)


@pytest.mark.parametrize(
    ("names", "width"),
    [
        ([["--run <str>"], ["--s3-endpoint-url <str>"]], 23),  # the type fits beside
        ([["--x <sglang|emulator|external|command>"]], 3 + 8),  # a long type wraps below
        ([["--mtp <bool>", "--no-mtp"]], 12),
        ([["--emulator-effective-max-running-requests <int>"], ["--x <int>"]], 47),
    ],
)
def test_the_names_column_is_as_wide_as_the_longest_flag(
    names: list[list[str]], width: int
) -> None:
    assert names_width([(lines, "") for lines in names]) == width
