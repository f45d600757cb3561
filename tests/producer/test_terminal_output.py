"""What the CLI prints on a terminal, read as a person reads it: the real `genfleet` process,
its stderr captured as text (rich strips markup there exactly as on a terminal)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import ROOT

pytestmark = pytest.mark.integration


def genfleet(*args: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", "from genfleet.producer.cli import main; main()", *args],
        env=env,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


def test_a_rejected_line_keeps_its_field_on_the_terminal(tmp_path: Path, redis_url: str) -> None:
    source = tmp_path / "p.jsonl"
    source.write_text('{"prompt": "fine"}\n{"prompt": 5}\n{"messages": "[bold]x[/]"}\n')
    env = {**os.environ, "GENFLEET_REDIS_URL": redis_url, "COLUMNS": "200", "TERM": "xterm"}
    store = (tmp_path / "store").as_uri()
    done = genfleet("enqueue", str(source), "--run", "rj", "--store", store, env=env)
    assert done.returncode == 0, done.stderr
    lines = [line.strip() for line in done.stderr.splitlines() if "rejected" in line]
    assert f"rejected {source}:2 [prompt]: must be a string, got int" in lines, done.stderr
    assert any(f"{source}:3 [messages]:" in line for line in lines), done.stderr


def test_an_error_quoting_the_input_keeps_its_brackets(tmp_path: Path, redis_url: str) -> None:
    source = tmp_path / "bad.jsonl"
    source.write_text('{"prompt": 5}\n')
    env = {**os.environ, "GENFLEET_REDIS_URL": redis_url, "COLUMNS": "200", "TERM": "xterm"}
    store = (tmp_path / "store").as_uri()
    failed = genfleet("enqueue", str(source), "--run", "rj", "--store", store, env=env)
    assert failed.returncode == 2
    said = " ".join(failed.stderr.split())  # rich wraps long lines
    assert f"first: {source}:1 [prompt]: must be a string" in said, failed.stderr
