"""A worker's Prometheus endpoint, scraped over HTTP while it runs a batch."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import httpx
import orjson
import pytest

from genfleet.common.settings import Settings
from genfleet.producer.enqueue import enqueue_run, reader_options
from harness.env import base_env, free_port
from harness.processes import Worker
from harness.waits import wait_for

pytestmark = [pytest.mark.integration, pytest.mark.slow]


def test_worker_exports_power_tokens_and_inflight(
    tmp_path: Path, redis_url: str, start_worker: Callable[..., Worker]
) -> None:
    store = (tmp_path / "store").as_uri()
    port = free_port()
    worker = start_worker(base_env(redis_url, store, metrics_port=port, sample_interval_s=0.25))
    settings = Settings(redis_url=redis_url, store=store, batch_size=20)
    source = tmp_path / "p.jsonl"
    source.write_bytes(b"".join(orjson.dumps({"prompt": f"q{i}"}) + b"\n" for i in range(40)))
    enqueue_run(settings, "metrics", str(source), reader_options(settings))
    worker.wait_ready()

    def scrape() -> str | None:
        try:
            text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=2).text
        except httpx.TransportError:
            return None
        tokens = [line for line in text.splitlines() if line.startswith("genfleet_tokens_total{")]
        return text if tokens and float(tokens[0].rsplit(" ", 1)[1]) > 0 else None

    text = wait_for(scrape, 60, "tokens in the worker's /metrics", 0.5)
    label = f'worker="{worker.hostname}"'
    power = [line for line in text.splitlines() if line.startswith("genfleet_gpu_power_watts{")]
    assert power and label in power[0] and 'gpu_uuid="EMU-' in power[0]
    limit = [
        line for line in text.splitlines() if line.startswith("genfleet_gpu_power_limit_watts{")
    ]
    assert limit and limit[0].endswith(" 700.0")
    assert f"genfleet_max_inflight{{{label}}}" in text
    assert "genfleet_underused{" in text


def test_underused_gauge_carries_the_cause(
    tmp_path: Path, redis_url: str, start_worker: Callable[..., Worker]
) -> None:
    store = (tmp_path / "store").as_uri()
    port = free_port()
    env = base_env(
        redis_url,
        store,
        metrics_port=port,
        sample_interval_s=0.25,
        power_window_s=3,
        power_watch_interval_s=1,
        mtp="false",
        max_inflight=1,
        emulator_time_scale=4,
    )
    worker = start_worker(env)
    settings = Settings(redis_url=redis_url, store=store, batch_size=10)
    source = tmp_path / "p.jsonl"
    source.write_bytes(b"".join(orjson.dumps({"prompt": f"q{i}"}) + b"\n" for i in range(100)))
    enqueue_run(settings, "slow", str(source), reader_options(settings))
    worker.wait_ready()
    gauge = 'genfleet_underused{cause="mtp_off",gpu_uuid="EMU-'

    def flagged() -> bool:
        try:
            text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=2).text
        except httpx.TransportError:
            return False
        lines = [line for line in text.splitlines() if line.startswith(gauge)]
        return bool(lines) and lines[0].endswith(" 1.0")

    wait_for(flagged, 60, "the underused gauge with cause mtp_off", 0.5)
