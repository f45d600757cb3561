"""A broker blip under long completions: Redis (AOF) restarted on the same port, a few seconds
away (longer than the batches' lease), while one worker has every prompt of several batches in
its engine and the control worker reaps leases.

The batches keep running across the reconnect and their orders are acknowledged on the new
connection: almost no prompt is sent to the engine a second time (before, every in-flight
completion was cancelled and sent again once the order came back), and every prompt ends up
exactly once in the export.
"""

from __future__ import annotations

import collections
import contextlib
import time
from collections.abc import Callable
from pathlib import Path

import orjson
import pytest
import redis

from genfleet.common import keys
from genfleet.common.ledger import work_order_of
from harness.assertions import assert_exactly_once
from harness.control import answering
from harness.env import base_env, free_port
from harness.processes import Worker
from harness.resends import prompt_of
from harness.runs import fault_settings, open_run_store, stage, wait_run_done
from harness.services import RedisServer
from harness.sources import write_prompts
from harness.waits import wait_for

pytestmark = [pytest.mark.fault, pytest.mark.integration, pytest.mark.slow]

PROMPTS = 128
BATCH = 32
AWAY_S = 4.0
RESENT_SHARE = 0.02  # of the prompts in flight when Redis went away


def sends(request_log: Path) -> collections.Counter[str]:
    """How many times the engine accepted each prompt (by its text or its hashed ids), from
    its request log."""
    counts: collections.Counter[str] = collections.Counter()
    if not request_log.exists():
        return counts
    for line in request_log.read_bytes().splitlines():
        prompt = prompt_of(orjson.loads(line))
        if prompt is not None:
            counts[prompt] += 1
    return counts


def held_orders(client: redis.Redis, run: str) -> list[tuple[str, str]]:
    """The orders of `run` in the broker's unacked hash (delivered, not acked)."""
    found = []
    for raw in client.hvals(keys.UNACKED):
        order = work_order_of(orjson.dumps(orjson.loads(raw)[0]))
        if order is not None and order[0] == run:
            found.append(order)
    return found


def test_a_redis_restart_does_not_resend_the_completions_in_flight(
    tmp_path: Path, private_redis: RedisServer, start_worker: Callable[..., Worker]
) -> None:
    request_log = tmp_path / "requests.jsonl"
    store_url = (tmp_path / "store").as_uri()
    env = base_env(
        private_redis.url,
        store_url,
        emulator_time_scale=1,
        emulator_mean_completion_tokens=700,
        emulator_request_log=request_log,
        max_running_requests=PROMPTS,
        max_inflight=PROMPTS,
        worker_concurrency=PROMPTS // BATCH,
        # Shorter than the outage: every lease lapses while Redis is away, and the reaper
        # must not take the batches of a live worker for lost ones.
        lease_ttl_s=2,
        reaper_interval_s=0.5,
        log_dir=tmp_path,
        port=free_port(),
    )
    control = start_worker(env, role="control")
    worker = start_worker(env)
    ids = write_prompts(tmp_path / "prompts.jsonl", PROMPTS)
    settings = fault_settings(private_redis.url, store_url, batch_size=BATCH, max_tokens=4096)
    control.wait_ready()
    worker.wait_ready()
    stage(settings, "blip", tmp_path / "prompts.jsonl")
    store = open_run_store(settings)
    wait_for(lambda: len(sends(request_log)) == PROMPTS, 60, "every prompt in the engine", 0.05)
    in_flight = PROMPTS - len(list(store.list(keys.outputs_prefix("blip"))))
    assert in_flight == PROMPTS, "a batch finished before Redis went away: too fast to test"

    private_redis.shutdown()
    time.sleep(AWAY_S)  # the outage itself: its length is the fault, not a wait for a state
    private_redis.start()

    client = private_redis.client()
    wait_run_done(settings, client, "blip", 120, store)
    assert_exactly_once(settings, "blip", ids, client, store)
    # Each order was acked on the new connection: the broker keeps no copy to deliver again.
    wait_for(lambda: not held_orders(client, "blip"), 30, "every order to be acked", 0.1)
    assert not client.llen("gpu.emulator")
    counts = sends(request_log)
    resent = sum(n - 1 for n in counts.values())
    print(f"\n[fault blip] {resent} of {in_flight} prompts in flight re-sent after the blip")
    assert resent <= RESENT_SHARE * in_flight, f"{resent} of {in_flight} prompts re-sent"
    assert worker.proc.poll() is None
    client.close()


def test_the_control_worker_survives_blips_while_its_beat_tasks_run(
    tmp_path: Path, private_redis: RedisServer, start_worker: Callable[..., Worker]
) -> None:
    """Beat tasks run all the time on the control worker (here every 0.1 s): a blip that
    finds one delivered and not acked must not end the worker (kombu could not restore it to
    a Redis that is away, and the worker stopped); after the blips it still reaps."""
    env = base_env(
        private_redis.url,
        (tmp_path / "store").as_uri(),
        reaper_interval_s=0.1,
        power_watch_interval_s=0.5,
        log_dir=tmp_path,
    )
    control = start_worker(env, role="control")
    control.wait_ready()

    def answers() -> bool:
        assert control.proc.poll() is None, f"the control worker ended:\n{control.tail()}"
        with contextlib.suppress(redis.RedisError, OSError):
            return control.hostname in answering(private_redis.url, [control.hostname])
        return False

    for _ in range(5):
        private_redis.shutdown()
        time.sleep(1.0)  # the outage itself
        private_redis.start()
        # Alive is what is asserted; how soon it reconnects follows Celery's retry backoff,
        # which grows when a retry falls into the next outage (tens of seconds under load).
        wait_for(answers, 90, "the control worker to answer again", 0.2)
    assert control.proc.poll() is None, control.tail()
    client = private_redis.client()
    client.delete(*client.keys("celery-task-meta-*") or ["none"])
    wait_for(lambda: client.keys("celery-task-meta-*"), 30, "a beat task after the blips", 0.2)
    assert control.proc.poll() is None, control.tail()
    client.close()


def test_batches_that_finish_while_redis_is_away_are_acked_and_the_worker_goes_on(
    tmp_path: Path, private_redis: RedisServer, start_worker: Callable[..., Worker]
) -> None:
    """Batches end while Redis is away, long enough that recording them as done fails and
    the retry cannot be sent (Celery then rejected the message without requeue, writing the
    failure to a result backend that was away too: the message was neither acked nor put
    back, its prefetch slot held for good, and the worker took no more work). Once Redis is
    back, each order is put back, found done and acked; the worker takes the rest."""
    request_log = tmp_path / "requests.jsonl"
    store_url = (tmp_path / "store").as_uri()
    env = base_env(
        private_redis.url,
        store_url,
        emulator_time_scale=4,
        emulator_mean_completion_tokens=200,
        emulator_request_log=request_log,
        worker_concurrency=2,
        lease_ttl_s=2,
        reaper_interval_s=0.5,
        log_dir=tmp_path,
        port=free_port(),
    )
    # The control worker sends again an order lost in kombu's own window (popped from the
    # queue as Redis went away, before its copy was in the unacked hash).
    control = start_worker(env, role="control")
    worker = start_worker(env)
    ids = write_prompts(tmp_path / "prompts.jsonl", 160)
    settings = fault_settings(private_redis.url, store_url, batch_size=16, max_tokens=512)
    control.wait_ready()
    worker.wait_ready()
    stage(settings, "ends", tmp_path / "prompts.jsonl")
    store = open_run_store(settings)
    wait_for(lambda: len(sends(request_log)) >= 32, 60, "two batches in the engine", 0.05)
    assert not list(store.list(keys.outputs_prefix("ends"))), "a batch ended before the outage"

    private_redis.shutdown()
    # The outage itself: longer than a finished batch's bookkeeping tries (1 + 2 + 4 s) and
    # its retry's backoff, so that the retry is sent while Redis is still away.
    time.sleep(AWAY_S * 3)
    assert list(store.list(keys.outputs_prefix("ends"))), "no batch ended during the outage"
    private_redis.start()

    client = private_redis.client()
    wait_run_done(settings, client, "ends", 90, store)
    assert_exactly_once(settings, "ends", ids, client, store)
    wait_for(lambda: not held_orders(client, "ends"), 30, "every order to be acked", 0.1)
    assert worker.proc.poll() is None
    client.close()
