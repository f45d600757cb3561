"""A worker serving another checkpoint under the run's model name hands the run back.

Two real emulator workers, one after the other, on one run: the first records its checkpoint
fingerprint in the run; the second, whose reasoning parser differs (same served name, same
queue), stops consuming with the order back in the queue, and writes nothing.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import orjson
import pytest
import redis

from genfleet.common import keys
from genfleet.common.settings import Settings
from genfleet.common.store import open_store
from genfleet.producer.enqueue import enqueue_run, reader_options
from harness.control import consuming
from harness.env import base_env
from harness.processes import Worker
from harness.runs import outputs
from harness.sources import write_prompts
from harness.waits import wait_for

pytestmark = [pytest.mark.integration, pytest.mark.slow]


def test_a_worker_of_another_checkpoint_hands_the_run_back(
    tmp_path: Path,
    redis_url: str,
    redis_client: redis.Redis,
    s3_server: str,
    s3_store_url: str,
    start_worker: Callable[..., Worker],
) -> None:
    env = base_env(redis_url, s3_store_url, s3_endpoint_url=s3_server, log_dir=tmp_path)
    settings = Settings(
        redis_url=redis_url, store=s3_store_url, s3_endpoint_url=s3_server, batch_size=10
    )
    store = open_store(s3_store_url, s3_server)
    write_prompts(tmp_path / "p.jsonl", 10)
    enqueue_run(settings, "bound", str(tmp_path / "p.jsonl"), reader_options(settings))
    first = start_worker(env, name="first")
    first.wait_ready()
    wait_for(lambda: outputs(store, "bound") == {"batch-000000"}, 60, "the first batch")
    first.stop()
    recorded = orjson.loads(store.get(keys.model_key("bound")) or b"{}")
    assert recorded["reasoning_parser"] == "qwen3" and recorded["fingerprint"]

    store.delete_prefix(keys.output_key("bound", "batch-000000"))  # to be generated again
    enqueue_run(settings, "bound", str(tmp_path / "p.jsonl"), reader_options(settings))
    other = start_worker({**env, "GENFLEET_REASONING_PARSER": "deepseek-r1"}, name="other")
    other.wait_ready()

    wait_for(lambda: consuming(other.hostname) == [], 60, "the other worker to stop consuming")
    wait_for(lambda: redis_client.llen("gpu.emulator") == 1, 30, "the order back in its queue")
    assert outputs(store, "bound") == set()
    assert not redis_client.hgetall(keys.failed_key("bound"))
