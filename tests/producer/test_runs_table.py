"""`genfleet runs` at the widths terminals have: no row wraps, no cell is cut."""

from __future__ import annotations

from genfleet.producer.runs.commands import COLUMNS, fit_columns

ROWS = [
    COLUMNS,
    ("alpaca-regen", "done", "/models/Qwen3.6-27B-Instruct", "sglang", "52002", "52002", "0",
     "2026-12-06 16:06"),
    ("x", "running", "m", "emulator", "10", "3", "0", "2026-12-06 16:07"),
]  # fmt: skip


def test_a_wide_terminal_gets_one_line_a_run() -> None:
    lines = fit_columns(ROWS, 160)
    assert len(lines) == 3 and "/models/Qwen3.6-27B-Instruct" in lines[1]


def test_at_80_columns_the_model_goes_under_its_run_and_nothing_is_cut() -> None:
    lines = fit_columns(ROWS, 80)
    assert all(len(line) <= 80 for line in lines)
    assert lines[0].split() == ["run", "state", "prompts", "done", "failed", "created"]
    assert lines[1].startswith("alpaca-regen") and lines[1].endswith("2026-12-06 16:06")
    assert lines[2].strip() == "/models/Qwen3.6-27B-Instruct (sglang)"
    assert lines[4].strip() == "m (emulator)"
