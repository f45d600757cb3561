"""`genfleet top`'s table at the widths terminals have: at 80 columns no title or figure is
cut with "…"; wide terminals get one line a GPU."""

from __future__ import annotations

from typing import Any

import pytest
from rich.console import Console

from genfleet.workers.observe.top import table

ROW: dict[str, Any] = {
    "worker": "gpu0@node-a",
    "gpu_name": "NVIDIA H100 80GB HBM3",
    "power_w": 612.4,
    "power_limit_w": 700.0,
    "tokens_per_s": 2158.4,
    "tokens_per_s_10m": 2043.9,
    "inflight": 71,
    "inflight_cap": 92,
    "accept_length": None,
    "j_per_token": 0.274,
    "verdict": "underused",
    "cause": "engine_capped",
}
TOTALS = {"fleet_tokens_per_s_1m": 2158.4, "fleet_tokens_per_s_10m": 2043.9}


def rendered(width: int) -> str:
    console = Console(width=width, record=True, color_system=None)
    console.print(table(([ROW], TOTALS), width))
    return console.export_text()


@pytest.mark.parametrize("width", [80, 100, 160])
def test_nothing_is_cut_and_every_figure_is_there(width: int) -> None:
    text = rendered(width)
    assert "…" not in text
    assert all(len(line) <= width for line in text.splitlines())
    for figure in ("gpu0@node-a", "612 / 700", "(87%)", "2158.4", "2043.9", "71 / 92", "0.274"):
        assert figure in text, (figure, text)
    assert "underused" in text and "engine_capped" in text  # words, never folded


def test_a_wide_terminal_gets_one_line_a_gpu() -> None:
    lines = [line for line in rendered(160).splitlines() if "gpu0@node-a" in line]
    assert len(lines) == 1 and "engine_capped" in lines[0]
