"""`genfleet top --once --json` and the MTP-ineffective alarm, against a real worker whose
emulated checkpoint accepts no drafts (accept length 1.0, as with missing MTP weights)."""

from __future__ import annotations

import subprocess
from collections.abc import Callable
from pathlib import Path
from typing import Any

import orjson
import pytest
import redis

from genfleet.common.settings import Settings
from genfleet.common.store import open_store
from genfleet.producer.enqueue import enqueue_run, reader_options
from genfleet.producer.status import run_status
from tests.conftest import ROOT, Worker, base_env, wait_for, worker_report

pytestmark = [pytest.mark.integration, pytest.mark.slow]


def test_top_json_rows_and_mtp_ineffective(
    tmp_path: Path,
    redis_url: str,
    redis_client: redis.Redis,
    start_worker: Callable[..., Worker],
) -> None:
    store = (tmp_path / "store").as_uri()
    env = base_env(redis_url, store, emulator_accept_length=1.0, power_window_s=5)
    worker = start_worker(env)
    settings = Settings(redis_url=redis_url, store=store, batch_size=20)
    source = tmp_path / "p.jsonl"
    source.write_bytes(b"".join(orjson.dumps({"prompt": f"q{i}"}) + b"\n" for i in range(40)))
    enqueue_run(settings, "mtp", str(source), reader_options(settings))
    worker.wait_ready()
    wait_for(
        lambda: run_status(open_store(store), redis_client, "mtp")["state"] == "done", 60, "run"
    )

    def top_rows() -> list[dict[str, object]] | None:
        result = subprocess.run(
            ["genfleet", "top", "--once", "--json"],
            env=env,
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=60,
            check=True,
        )
        rows = [orjson.loads(line) for line in result.stdout.splitlines() if line.strip()]
        mine = [r for r in rows if r["worker"] == worker.hostname]
        return mine if mine and mine[0]["accept_length"] is not None else None

    rows = wait_for(top_rows, 60, "a top row with an accept length", 1.0)
    assert len(rows) == 1
    row = rows[0]
    expected = {
        "worker",
        "gpu_uuid",
        "power_w",
        "power_limit_w",
        "tokens_per_s",
        "inflight",
        "inflight_cap",
        "accept_length",
        "j_per_token",
        "verdict",
        "cause",
    }
    assert expected <= set(row)
    assert str(row["gpu_uuid"]).startswith("EMU-")
    assert row["power_limit_w"] == 700.0
    assert row["accept_length"] is not None and float(row["accept_length"]) < 1.2
    assert (row["verdict"], row["cause"]) == ("mtp_ineffective", "mtp_ineffective")

    # the worker itself found it after its batches, and reports the finding
    def alarm() -> dict[str, Any] | None:
        findings = worker_report(redis_url, worker.hostname).get("findings") or []
        return findings[-1] if findings else None

    finding = wait_for(alarm, 10, "the worker's own finding")
    assert finding["cause"] == "mtp_ineffective" and finding["accept_length"] < 1.2
