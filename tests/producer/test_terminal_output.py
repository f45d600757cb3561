"""What the CLI prints on a terminal, read as a person reads it: the real `genfleet` process,
its stderr captured as text (rich strips markup there exactly as on a terminal)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from genfleet.producer.commands import status_line
from genfleet.producer.console import format_eta, plural
from tests.support.commands import genfleet


@pytest.mark.integration
def test_a_rejected_line_keeps_its_field_on_the_terminal(tmp_path: Path, redis_url: str) -> None:
    source = tmp_path / "p.jsonl"
    source.write_text('{"prompt": "fine"}\n{"prompt": 5}\n{"messages": "[bold]x[/]"}\n')
    env = {**os.environ, "GENFLEET_REDIS_URL": redis_url, "COLUMNS": "200", "TERM": "xterm"}
    store = (tmp_path / "store").as_uri()
    done = genfleet(["enqueue", str(source), "--run", "rj", "--store", store], env, timeout_s=60)
    assert done.returncode == 0, done.stderr
    lines = [line.strip() for line in done.stderr.splitlines() if "rejected" in line]
    assert f"rejected {source}:2 [prompt]: must be a string, got int" in lines, done.stderr
    assert any(f"{source}:3 [messages]:" in line for line in lines), done.stderr


@pytest.mark.integration
def test_an_error_quoting_the_input_keeps_its_brackets(tmp_path: Path, redis_url: str) -> None:
    source = tmp_path / "bad.jsonl"
    source.write_text('{"prompt": 5}\n')
    env = {**os.environ, "GENFLEET_REDIS_URL": redis_url, "COLUMNS": "200", "TERM": "xterm"}
    store = (tmp_path / "store").as_uri()
    failed = genfleet(["enqueue", str(source), "--run", "rj", "--store", store], env, timeout_s=60)
    assert failed.returncode == 2
    said = " ".join(failed.stderr.split())  # rich wraps long lines
    assert f"first: {source}:1 [prompt]: must be a string" in said, failed.stderr


@pytest.mark.parametrize(
    ("count", "word", "many", "text"),
    [
        (1, "batch", "batches", "1 batch"),
        (3, "batch", "batches", "3 batches"),
        (0, "line", None, "0 lines"),
        (43586, "token", None, "43,586 tokens"),
    ],
)
def test_plural(count: int, word: str, many: str | None, text: str) -> None:
    assert plural(count, word, many) == text


@pytest.mark.parametrize(
    ("eta_s", "text"),
    [(None, "-"), (0.0, "0:00:00"), (59.6, "0:01:00"), (75.0, "0:01:15"), (3725.0, "1:02:05")],
)
def test_one_eta_format(eta_s: float | None, text: str) -> None:
    assert format_eta(eta_s) == text


REPORT = {
    "run": "r",
    "batches_total": 10,
    "batches_done": 3,
    "batches_failed": 0,
    "prompts_total": 200,
    "prompts_done": 60,
    "completion_tokens": 43586,
}


@pytest.mark.parametrize(
    ("changes", "line"),
    [
        (
            {"state": "running", "tokens_per_s": 4407.2, "eta_s": 75.0, "duration_s": 10.0},
            "r: running — batches 3/10 done, 0 failed; prompts 60/200; 43,586 tokens; "
            "4,407 tok/s; ETA 0:01:15",
        ),
        (
            {"state": "queued", "tokens_per_s": 0.0, "eta_s": None, "duration_s": None},
            "r: queued — batches 3/10 done, 0 failed; prompts 60/200; 43,586 tokens; "
            "0 tok/s; ETA -",
        ),
        (
            {
                "state": "done",
                "tokens_per_s": 1320.8,
                "eta_s": 0.0,
                "duration_s": 33.0,
                "batches_done": 10,
                "prompts_done": 200,
            },
            "r: done — batches 10/10 done, 0 failed; prompts 200/200; 43,586 tokens; "
            "mean 1,321 tok/s over 0:00:33",
        ),
    ],
)
def test_status_line(changes: dict[str, object], line: str) -> None:
    assert status_line({**REPORT, **changes}) == line
