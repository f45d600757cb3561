"""A run's model is decided where the run is made, and a worker serving another hands back
that run's orders only.

Two runs on the emulator queue: `plain` staged as the checkpoint comes, `fp8` staged with
`--quantization fp8` among the engine's extra args; the producer records each run's model at
staging. Two real emulator workers on that queue, one of each kind. The `fp8` worker starts
alone: it generates the `fp8` run while it hands `plain`'s orders back (no hot loop on them),
a `model_mismatch` finding names it, the run and the difference, and `status` says `plain`'s
orders are held because no worker serves its model. Then the plain worker comes and
generates `plain`. Every prompt of both runs is done exactly once, each by its own model.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

import orjson
import pytest
import redis

from genfleet.common import keys
from genfleet.common.celery_config import HANDED_BACK_RESULT_EXPIRES_S
from genfleet.common.records import decode_jsonl_gz
from genfleet.common.settings import Settings
from genfleet.common.store import Store, open_store
from genfleet.producer.status import read_findings
from harness.assertions import assert_exactly_once
from harness.control import consuming
from harness.env import base_env, free_port
from harness.processes import Worker
from harness.runs import outputs, stage, wait_run_done
from harness.sources import write_prompts
from harness.waits import wait_for
from tests.support.commands import invoke

pytestmark = [pytest.mark.integration, pytest.mark.slow]

FP8 = "--quantization fp8"


def hand_backs(client: redis.Redis, run: str) -> list[bytes]:
    """The run's orders workers handed back as not theirs: their task results' keys."""
    found = []
    for key in client.scan_iter("celery-task-meta-*"):
        result = orjson.loads(client.get(key) or b"{}").get("result")
        if isinstance(result, dict) and result.get("run") == run and result.get("refused"):
            found.append(key)
    return found


def generated_by(store: Store, run: str) -> set[str]:
    """The workers that wrote the run's answers (each record names its engine's worker)."""
    return {
        str(record["engine"]["worker"])
        for key in store.list(f"{run}/outputs/")
        for record in decode_jsonl_gz(store.get(key) or b"")
    }


def test_a_worker_of_another_model_hands_back_one_runs_orders_and_generates_the_others(
    tmp_path: Path,
    redis_url: str,
    redis_client: redis.Redis,
    start_worker: Callable[..., Worker],
) -> None:
    store_url = (tmp_path / "store").as_uri()
    env = base_env(redis_url, store_url, log_dir=tmp_path)
    plain = Settings(redis_url=redis_url, store=store_url, batch_size=10)
    fp8 = plain.model_copy(update={"engine_extra_args": FP8})
    store = open_store(store_url)
    ids = {run: write_prompts(tmp_path / f"{run}.jsonl", 30, prefix=run) for run in ("p", "q")}
    odd = start_worker(
        {**env, "GENFLEET_ENGINE_EXTRA_ARGS": FP8, "GENFLEET_PORT": str(free_port())}, name="fp8"
    )
    stage(plain, "plain", tmp_path / "p.jsonl")  # ahead of fp8's orders in the queue
    stage(fp8, "fp8", tmp_path / "q.jsonl")
    for run, asks in (("plain", None), ("fp8", "fp8")):  # decided by the producer, at staging
        recorded = orjson.loads(store.get(keys.model_key(run)) or b"{}")
        assert recorded.get("asks", {}).get("quantization", "none recorded") == asks

    odd.wait_ready()
    wait_run_done(fp8, redis_client, "fp8", 60, store)
    assert consuming(odd.hostname) == ["gpu.emulator"]  # it never stopped consuming
    assert outputs(store, "plain") == set()
    [finding] = [
        f for f in read_findings(redis_client, "plain") if f.get("cause") == "model_mismatch"
    ]
    assert (finding["worker"], finding["run"], finding["verdict"]) == (
        odd.hostname,
        "plain",
        "refused",
    )
    assert [d.split(":")[0] for d in finding["numbers"]["differences"]] == ["quantization"]

    # plain's orders go round a queue only the fp8 worker consumes: held, said so, and slowly.
    # Each of its 3 batch slots rests 2 s after a hand-back, so six more take at least 2 s.
    before, since = len(hand_backs(redis_client, "plain")), time.monotonic()
    wait_for(lambda: len(hand_backs(redis_client, "plain")) >= before + 6, 30, "six hand-backs")
    assert time.monotonic() - since >= 2.0  # a hot loop would take milliseconds
    ttls = {redis_client.ttl(key) for key in hand_backs(redis_client, "plain")}
    assert 0 < max(ttls) <= HANDED_BACK_RESULT_EXPIRES_S  # their results go within the hour
    status = invoke("status", "plain", "--json", env=env)
    assert status.exit_code == 0, status.output
    report = orjson.loads(status.stdout)
    assert report["state"] == "queued" and report["batches_failed"] == 0
    assert report["unconsumed"]["held"] is True
    assert "no worker serves the run's model" in report["unconsumed"]["message"]
    assert list(report["unconsumed"]["refused_by"]) == [odd.hostname]
    assert "quantization" in report["model_refusals"][odd.hostname]["why"]
    printed = invoke("status", "plain", env=env)  # and on the terminal, naming the worker
    assert printed.exit_code == 0 and odd.hostname in printed.output, printed.output

    healthy = start_worker({**env, "GENFLEET_PORT": str(free_port())}, name="plain")
    healthy.wait_ready()
    wait_run_done(plain, redis_client, "plain", 60, store)

    assert_exactly_once(plain, "plain", ids["p"], redis_client, store)
    assert_exactly_once(fp8, "fp8", ids["q"], redis_client, store)
    assert generated_by(store, "plain") == {healthy.hostname}
    assert generated_by(store, "fp8") == {odd.hostname}
    assert not redis_client.hgetall(keys.failed_key("plain"))
