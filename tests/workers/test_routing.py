"""Orders go to engines of their model: a worker consumes only its model's queue, and one that
receives an order for another model hands it back, never generating it."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import redis

from genfleet.common import keys
from genfleet.common.settings import Settings
from genfleet.common.store import open_store
from genfleet.producer.broker import orders_in_broker
from genfleet.producer.enqueue import enqueue_run, reader_options
from genfleet.workers.admission import decide, deleted_staging
from harness.assertions import assert_exactly_once
from harness.env import base_env
from harness.processes import Worker
from harness.runs import stage_other_model_run, wait_run_done
from harness.sources import write_prompts
from harness.waits import wait_for
from tests.support.commands import genfleet


@pytest.mark.parametrize(
    ("my_queue", "its_queue", "deleted", "cancelled", "verdict"),
    [
        ("gpu.emulator", "gpu.emulator", False, False, "generate"),
        ("gpu.emulator", "gpu.q", False, False, "hand_back"),
        ("gpu.emulator", "gpu.q", True, True, "hand_back"),  # its own workers decide
        ("gpu.q", "gpu.q", True, False, "drop"),  # an order of the deleted staging
        ("gpu.q", "gpu.q", True, True, "drop"),
        ("gpu.q", "gpu.q", False, True, "park"),
    ],
)
def test_decide(
    my_queue: str, its_queue: str, deleted: bool, cancelled: bool, verdict: str
) -> None:
    assert decide(my_queue, its_queue, deleted, cancelled) == verdict


@pytest.mark.parametrize(
    ("tombstone", "staging", "deleted"),
    [
        (None, "s1", False),
        (b"s1", "s1", True),  # the deleted staging's order
        (b"s1", "s2", False),  # a new run of the same name: whatever the clocks say
        (b"", "", True),  # an older order names no staging: dropped while the tombstone lives
        (b"s1", "", True),
    ],
)
def test_deleted_staging(tombstone: bytes | None, staging: str, deleted: bool) -> None:
    assert deleted_staging(tombstone, staging) is deleted


@pytest.mark.integration
def test_an_order_for_another_model_is_handed_back_never_generated(
    tmp_path: Path,
    redis_url: str,
    redis_client: redis.Redis,
    start_worker: Callable[..., Worker],
) -> None:
    store_url = (tmp_path / "store").as_uri()
    worker = start_worker(base_env(redis_url, store_url, log_dir=tmp_path))
    # A model run on the same Redis and store: its orders wait on its model's queue.
    staged = stage_other_model_run(redis_url, store_url, tmp_path)
    assert staged.queue == "gpu.other-model"
    assert redis_client.llen("gpu.other-model") == 2
    # One of them is misdelivered onto the emulator's queue.
    redis_client.lmove("gpu.other-model", "gpu.emulator", "RIGHT", "LEFT")
    assert redis_client.llen("gpu.emulator") == 1

    emulator = Settings(redis_url=redis_url, store=store_url, batch_size=10, max_tokens=1024)
    ids = write_prompts(tmp_path / "e.jsonl", 30, prefix="e")
    enqueue_run(emulator, "emu-run", str(tmp_path / "e.jsonl"), reader_options(emulator))
    worker.wait_ready()
    wait_run_done(emulator, redis_client, "emu-run", 90)
    _, rows = assert_exactly_once(emulator, "emu-run", ids, redis_client)
    assert {row["engine"]["kind"] for row in rows} == {"emulator"}

    # The misdelivered order is back on its model's queue; the emulator generated nothing of
    # the model run (no output, no checkpoint) and left nothing of it on its own queue.
    wait_for(lambda: redis_client.llen("gpu.other-model") == 2, 30, "the order to be handed back")
    assert redis_client.llen("gpu.emulator") == 0
    assert orders_in_broker(redis_client, "gpu.other-model", "model-run") == {
        keys.batch_id(0),
        keys.batch_id(1),
    }
    store = open_store(store_url)
    assert list(store.list("model-run/outputs/")) == []
    assert list(store.list("model-run/parts/")) == []
    assert redis_client.hget(keys.counters_key("model-run"), "started_at") is None


def test_a_worker_with_no_model_and_no_engine_says_it_runs_the_emulator_first(
    tmp_path: Path,
) -> None:
    env = base_env("redis://127.0.0.1:1/0", tmp_path.as_uri())
    command = ["worker", "--print-engine-command"]
    bare = genfleet(command, env, timeout_s=60)
    named = genfleet([*command, "--model", "/m/q", "--served-model-name", "q"], env, timeout_s=60)
    assert bare.returncode == 0 and named.returncode == 0, bare.stderr + named.stderr
    assert "gpu.emulator" in bare.stderr.splitlines()[2]  # before anything else it says
    assert "emulator" in bare.stdout  # what it launches: the emulator
    assert named.stderr == ""
