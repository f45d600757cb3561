"""genfleet end to end on a real GPU engine: `bench/h200_run.sh` with `transformers serve`.

Runs only on a machine with an NVIDIA GPU, transformers, torch and the carried Redis
(`bench/prepare_h200_carry.sh` fills `.carry/`): `pytest -m gpu tests/workers/`.
It builds a random-initialised Qwen3, enqueues prompts, runs a worker that supervises
`transformers serve` through `--engine command`, checks every prompt has an output, that the
power-watch judged the GPU from NVML while work waited, and that `tune` wrote its table.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest

from harness.env import ROOT

pytestmark = [pytest.mark.gpu, pytest.mark.integration, pytest.mark.slow]


def test_transformers_serve_end_to_end(tmp_path: Path) -> None:
    if shutil.which("nvidia-smi") is None:
        pytest.fail("no nvidia-smi: run the gpu tests on a GPU machine only")
    if not (ROOT / ".carry" / "redis").is_dir():
        pytest.fail("no .carry/redis: run bench/prepare_h200_carry.sh first")
    out = tmp_path / "out"
    env = {
        **os.environ,
        "OUT": str(out),
        "WORK": str(tmp_path / "work"),
        "PROMPTS": "200",
        "TUNE_CONCURRENCY": "1,16,64",
        "TUNE_DURATION_S": "10",
    }
    done = subprocess.run(
        ["bash", str(ROOT / "bench" / "h200_run.sh")], env=env, cwd=ROOT, timeout=900
    )
    assert done.returncode == 0
    e2e = json.loads((out / "h200_e2e.json").read_text())
    assert e2e["status"]["state"] == "done"
    assert e2e["status"]["prompts_done"] == 200
    assert e2e["status"]["completion_tokens"] > 0
    tops = [json.loads(line) for line in (out / "h200_top.jsonl").read_text().splitlines() if line]
    rows = [row for top in tops for row in (top if isinstance(top, list) else [top])]
    judged = [
        r for r in rows if r.get("power_limit_w") and r.get("gpu_uuid", "").startswith("GPU-")
    ]
    assert judged, "the power-watch never judged the GPU from NVML"
    assert any(r["verdict"] in {"underused", "ok"} for r in judged)
    tune = json.loads((out / "h200_tune.json").read_text())
    assert [p["concurrency"] for p in tune["points"]] == [1, 16, 64]
    assert all(p["tokens_per_s"] > 0 and p["power_w"] > 0 for p in tune["points"])
    assert "GENFLEET_MAX_INFLIGHT=" in (out / "h200_tuned.env").read_text()
