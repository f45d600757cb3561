"""No command ends in a traceback on a user's mistake: every `genfleet` command, run as a real
process on bad input (a missing or malformed file, an unknown run, a bad option value, a Redis
that does not answer), exits non-zero with one `error:` line that names the problem.

The commands are read from the command line itself: a new command fails
`test_every_command_has_bad_inputs` until it gets its cases here.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import typer

from genfleet.cli import app
from harness.env import base_env
from tests.support.commands import genfleet

root = typer.main.get_command(app)
COMMANDS = list(root.list_commands(typer.Context(root)))  # type: ignore[attr-defined]

DOWN = "redis://127.0.0.1:1/0"  # nothing listens on port 1
NO_REDIS = "no Redis answers"

# command → (argv after the command, Redis down?, what the error names). `{missing}` is a file
# that does not exist, `{bad}` a JSONL file cut inside its first record, `{dir}` an empty folder,
# `{binary}` bytes that are not text.
CASES: dict[str, list[tuple[list[str], bool, str]]] = {
    "enqueue": [
        (["{missing}", "--run", "r"], False, "no such file"),
        (["{bad}", "--run", "r"], False, "not JSON"),
        (["--resume", "nosuch"], False, "no manifest"),
        (["{bad}", "--run", "r", "--batch-size", "0"], False, "--batch-size"),
        (["{bad}", "--run", "r"], True, NO_REDIS),
    ],
    "status": [
        (["nosuch"], False, "no run 'nosuch'"),
        (["nosuch", "--gpu-hour-cost", "abc"], False, "--gpu-hour-cost"),
        (["nosuch"], True, NO_REDIS),
    ],
    "retry": [(["nosuch"], False, "no manifest"), (["nosuch"], True, NO_REDIS)],
    "export": [
        (["nosuch", "--out", "{dir}/x.jsonl"], False, "no manifest"),
        (["nosuch", "--out", "{dir}/x.jsonl", "--format", "bogus"], False, "'bogus'"),
        (["--out", "{dir}/x.jsonl"], False, "Missing argument"),
    ],
    "report": [
        (["nosuch"], False, "no manifest"),
        (["nosuch", "--gpu-hour-cost", "abc"], False, "--gpu-hour-cost"),
    ],
    "findings": [([], True, NO_REDIS), (["--run"], False, "--run")],
    "run": [
        (["{missing}"], False, "no such file"),
        (["{bad}"], False, "not JSON"),
        (["{bad}"], True, NO_REDIS),
    ],
    "settings": [
        (["--max-inflight", "abc"], False, "--max-inflight"),
        (["--store", "ftp://x"], False, "--store"),
        (["--settings-file", "{missing}"], False, "--settings-file"),
        (["--settings-file", "{binary}"], False, "not UTF-8"),
    ],
    "runs": [([], True, NO_REDIS)],
    "cancel": [(["nosuch"], False, "no run 'nosuch'"), (["nosuch"], True, NO_REDIS)],
    "delete": [
        (["nosuch", "--yes"], False, "no run 'nosuch'"),
        (["nosuch", "--yes"], True, NO_REDIS),
    ],
    "worker": [([], True, NO_REDIS), (["--tp-size", "abc"], False, "--tp-size")],
    "control": [([], True, NO_REDIS)],
    "preflight": [
        (["--model", "{missing}"], False, "does not exist"),
        (["--model", "{dir}"], False, "config.json"),
    ],
    "top": [(["--once"], True, NO_REDIS)],
    "tune": [
        (["--mtp", "bogus"], False, "'bogus'"),
        (["--concurrency", "abc"], False, "'abc'"),
    ],
    "flower": [([], True, NO_REDIS), (["--port", "abc"], False, "--port")],
}


def test_every_command_has_bad_inputs() -> None:
    assert sorted(CASES) == sorted(COMMANDS)


def _argv(args: list[str], tmp_path: Path) -> list[str]:
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "cut here\n')
    folder = tmp_path / "empty"
    folder.mkdir(exist_ok=True)
    binary = tmp_path / "binary.env"
    binary.write_bytes(b"\x00\xff\xfe")
    places = {
        "{missing}": str(tmp_path / "missing.jsonl"),
        "{bad}": str(bad),
        "{dir}": str(folder),
        "{binary}": str(binary),
    }
    out = []
    for arg in args:
        for name, value in places.items():
            arg = arg.replace(name, value)
        out.append(arg)
    return out


def _refused(result_out: str, result_err: str, code: int, names: str) -> None:
    both = result_out + result_err
    assert code != 0, both
    assert "Traceback" not in both, both
    assert "error:" in result_err, both
    error_lines = [line for line in result_err.splitlines() if "error:" in line]
    assert any(names in line for line in error_lines), both


@pytest.mark.parametrize(
    ("command", "args", "redis_down", "names"),
    [
        pytest.param(command, args, down, names, id=f"{command}-{i}")
        for command, cases in CASES.items()
        for i, (args, down, names) in enumerate(cases)
    ],
)
def test_bad_input_is_one_error_line(
    command: str, args: list[str], redis_down: bool, names: str, redis_url: str, tmp_path: Path
) -> None:
    env = base_env(DOWN if redis_down else redis_url, (tmp_path / "store").as_uri())
    done = genfleet([command, *_argv(args, tmp_path)], env, timeout_s=60)
    _refused(done.stdout, done.stderr, done.returncode, names)


@pytest.mark.parametrize("command", COMMANDS)
def test_an_unknown_flag_is_one_error_line(command: str, redis_url: str, tmp_path: Path) -> None:
    env = base_env(redis_url, (tmp_path / "store").as_uri())
    done = genfleet([command, "--no-such-flag"], env, timeout_s=60)
    _refused(done.stdout, done.stderr, done.returncode, "--no-such-flag")
