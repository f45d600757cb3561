"""What real SGLang answered, recorded (tests/golden/): read back, or changed where a test
needs a figure the recording machine did not give."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

SGLANG_0_5_15 = Path(__file__).resolve().parents[1] / "golden" / "sglang-0.5.15"

_UNSET: Any = object()


def server_info(
    name: str = "server_info.json",
    *,
    configured: int | None = _UNSET,
    per_dp: int | None = _UNSET,
    mamba: int | None = _UNSET,
) -> dict[str, Any]:
    """A recorded `/server_info` of SGLang 0.5.15 on the hybrid Qwen3.6 layout (configured
    `--max-running-requests 4`, enforced 4, `max_mamba_cache_size` 7299 in internal_states),
    with the configured cap (top level), the enforced one per DP rank and the state pool
    size (internal_states[0]) changed where given."""
    info: dict[str, Any] = json.loads((SGLANG_0_5_15 / name).read_text())
    state = dict(info["internal_states"][0])
    if configured is not _UNSET:
        info["max_running_requests"] = configured
    if per_dp is not _UNSET:
        state["effective_max_running_requests_per_dp"] = per_dp
    if mamba is not _UNSET:
        state["max_mamba_cache_size"] = mamba
    info["internal_states"] = [state]
    return info
