"""An engine that refuses the worker itself (a wrong API key: 401) is a configuration error:
the worker stops consuming and hands the order back, spending none of the batch's tries.

A real worker process whose engine (the emulator, launched as a `--engine command`) expects
another key than the one the worker sends.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path

import orjson
import pytest
import redis

from genfleet.common import keys
from genfleet.common.routing import worker_queue
from genfleet.common.settings import Settings
from genfleet.producer.enqueue import enqueue_run, reader_options
from harness.control import consuming
from harness.env import base_env
from harness.processes import Worker
from harness.waits import wait_for

pytestmark = [pytest.mark.integration, pytest.mark.slow]


def test_a_401_stops_the_worker_consuming_and_spends_no_try(
    tmp_path: Path,
    redis_url: str,
    redis_client: redis.Redis,
    start_worker: Callable[..., Worker],
) -> None:
    command = (
        f"{sys.executable} -m genfleet.workers.engine.emulator --model-path m "
        "--port {port} --api-key the-right-key"
    )
    store_url = (tmp_path / "store").as_uri()
    env = base_env(
        redis_url,
        store_url,
        engine="command",
        engine_command=command,
        engine_api_key="a-wrong-key",
    )
    worker = start_worker(env)
    source = tmp_path / "prompts.jsonl"
    source.write_bytes(b"".join(orjson.dumps({"prompt": f"q{i}"}) + b"\n" for i in range(5)))
    # the producer names the engine the worker serves, so the order lands on its queue
    settings = Settings(
        redis_url=redis_url,
        store=store_url,
        batch_size=5,
        engine="command",
        engine_command=command,
    )
    enqueue_run(settings, "refused", str(source), reader_options(settings))
    worker.wait_ready()

    wait_for(lambda: consuming(worker.hostname) == [], 60, "the worker to stop consuming", 0.5)
    assert worker.proc.poll() is None  # alive, saying why, not crashing in a loop
    # the order is back in the queue, untouched: no try spent, nothing failed
    queue = worker_queue(settings)
    wait_for(lambda: redis_client.llen(queue) == 1, 30, "the order back in its queue")
    assert not redis_client.hgetall(keys.attempts_key("refused"))
    assert not redis_client.hgetall(keys.failed_key("refused"))
    assert redis_client.sismember(keys.queued_key("refused"), "batch-000000")
