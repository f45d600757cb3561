"""Lost orders: the reconciler's decision as a table, and a lost order sent again on a real
fleet (control worker + GPU worker), with `status --watch` giving up, saying why, where no
worker ever comes."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import redis

from genfleet.common import keys
from genfleet.common.ledger import Ledger, work_order_of
from genfleet.common.records import WorkOrder
from genfleet.workers.control import lost_orders
from genfleet.workers.control.lost_orders import RunOrders, reconcile, reconcile_orders
from harness.assertions import assert_exactly_once
from harness.env import base_env, free_port
from harness.processes import Worker
from harness.runs import fault_settings, stage, wait_run_done
from harness.sources import write_prompts
from tests.fakes.memory_store import MemoryStore
from tests.support.commands import genfleet
from tests.support.stored_runs import STAGING_ID, prompts, stage_prompts

LEASE_S = 60.0


def orders(queued: str, held: str = "", done: str = "") -> RunOrders:
    return RunOrders(frozenset(queued.split()), frozenset(held.split()), frozenset(done.split()))


@pytest.mark.parametrize(
    ("facts", "missing_since", "now", "resend", "watch", "finished"),
    [
        # every queued batch held somewhere: nothing to do, nothing watched
        (orders("a b", held="a b"), {}, 100.0, [], {}, []),
        # first look at a missing batch: watched from now, not sent
        (orders("a b", held="a"), {}, 100.0, [], {"b": 100.0}, []),
        # missing, but for less than a lease
        (orders("a b", held="a"), {"b": 50.0}, 100.0, [], {"b": 50.0}, []),
        # missing for a lease: sent again (and no longer watched)
        (orders("a b", held="a"), {"b": 40.0}, 100.0, ["b"], {}, []),
        # held again since it was seen missing: forgotten
        (orders("a b", held="a b"), {"b": 0.0}, 100.0, [], {}, []),
        # not held but done: not missing, taken off the queued set
        (orders("a b", held="a", done="b"), {"b": 0.0}, 100.0, [], {}, ["b"]),
        # a watched batch no longer queued (failed, parked, cancelled): forgotten
        (orders("a", held="a"), {"b": 0.0}, 100.0, [], {}, []),
    ],
)
def test_reconcile_sends_again_only_what_was_missing_for_a_lease(
    facts: RunOrders,
    missing_since: dict[str, float],
    now: float,
    resend: list[str],
    watch: dict[str, float],
    finished: list[str],
) -> None:
    verdict = reconcile(facts, missing_since, now, LEASE_S)
    assert (verdict.resend, verdict.missing_since, verdict.finished) == (resend, watch, finished)


def drop_order(client: redis.Redis, run: str, batch: str, queue: str = "gpu.emulator") -> None:
    """Remove `batch`'s waiting work order from the broker, as a lost hand-back leaves it."""
    for raw in client.lrange(queue, 0, -1):
        if work_order_of(raw) == (run, batch):
            assert client.lrem(queue, 0, raw)
            return
    raise AssertionError(f"no order of {run}/{batch} in {queue}")


@pytest.mark.integration
def test_a_lost_order_is_made_from_one_shard_bound_to_its_staging(
    redis_client: redis.Redis,
) -> None:
    """The order sent again carries the run's staging id and the batch's content hash (a
    worker checks both) and is made from the one manifest shard that holds the batch."""
    store = MemoryStore()
    manifest = stage_prompts(store, "lost", prompts(30), batch_size=1, shard_batches=4)
    redis_client.sadd(keys.runs_key(), "lost")
    Ledger(redis_client).mark_queued("lost", ["batch-000013"])
    sent: list[WorkOrder] = []
    assert reconcile_orders(redis_client, store, LEASE_S, sent.append, now=1000.0)["resent"] == []
    store.reads.clear()

    found = reconcile_orders(redis_client, store, LEASE_S, sent.append, now=1000.0 + LEASE_S)

    shard = keys.manifest_shard_key("lost", STAGING_ID, 3)
    # the index, the probe for a change of its parameters (the order carries the run's
    # parameters as they stand), and the one shard
    assert store.reads == [keys.manifest_key("lost"), keys.params_change_key("lost", 1), shard]
    assert found["resent"] == ["lost/batch-000013"] and [o.batch for o in sent] == ["batch-000013"]
    entry = manifest.entry(store, "batch-000013")
    assert entry is not None and entry.sha256
    assert (sent[0].staging, sent[0].input_sha256, sent[0].prompts) == (
        STAGING_ID,
        entry.sha256,
        1,
    )


def test_while_the_queues_hold_many_orders_a_pass_reads_none_and_keeps_its_watch(
    redis_client: redis.Redis, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A pass costs what the fleet holds, not what waits: above MAX_WAITING orders it reads
    no message; a batch watched as missing keeps its first look, and is sent again a lease
    after it once the queues drain."""
    monkeypatch.setattr(lost_orders, "MAX_WAITING", 10)
    store = MemoryStore()
    stage_prompts(store, "lost", prompts(30), batch_size=1, shard_batches=4)
    redis_client.sadd(keys.runs_key(), "lost")
    redis_client.sadd(keys.work_queues_key(), "gpu.q")
    Ledger(redis_client).mark_queued("lost", ["batch-000013"])
    sent: list[WorkOrder] = []
    reconcile_orders(redis_client, store, LEASE_S, sent.append, now=1000.0)  # watched from now
    redis_client.rpush("gpu.q", *[b"{}" for _ in range(11)])  # another run's backlog
    reads: list[str] = []
    monkeypatch.setattr(lost_orders, "held_orders", lambda *a: reads.append("held") or set())

    deferred = reconcile_orders(redis_client, store, LEASE_S, sent.append, now=1000.0 + LEASE_S)

    assert (deferred["deferred"], deferred["resent"], reads, sent) == (11, [], [], [])
    redis_client.delete("gpu.q")  # drained
    found = reconcile_orders(redis_client, store, LEASE_S, sent.append, now=1001.0 + LEASE_S)
    assert found["resent"] == ["lost/batch-000013"]  # the first look of before the backlog


def test_a_pass_looks_at_a_bounded_number_of_queued_batches(
    redis_client: redis.Redis, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A whole run's orders purged: they are sent again at most MAX_BATCHES a pass, each
    once, the pass moving on as the fleet finishes them (each answered at once here)."""
    monkeypatch.setattr(lost_orders, "MAX_BATCHES", 8)
    store = MemoryStore()
    manifest = stage_prompts(store, "lost", prompts(30), batch_size=1, shard_batches=4)
    redis_client.sadd(keys.runs_key(), "lost")
    ledger = Ledger(redis_client)
    ledger.mark_queued("lost", manifest.batch_ids())
    sent: list[WorkOrder] = []

    def send(order: WorkOrder) -> None:
        sent.append(order)
        store.put(keys.output_key("lost", order.batch), b"answered")

    for step in range(40):
        found = reconcile_orders(redis_client, store, LEASE_S, send, now=1000.0 + step * LEASE_S)
        assert len(found["resent"]) <= 8
        if not ledger.queued("lost"):
            break

    assert sorted(o.batch for o in sent) == sorted(manifest.batch_ids())  # each once
    assert ledger.queued("lost") == set()


@pytest.mark.integration
@pytest.mark.slow
def test_a_lost_order_is_sent_again_and_the_run_finishes(
    tmp_path: Path,
    redis_url: str,
    redis_client: redis.Redis,
    start_worker: Callable[..., Worker],
) -> None:
    store = (tmp_path / "store").as_uri()
    settings = fault_settings(redis_url, store, batch_size=20)
    ids = write_prompts(tmp_path / "prompts.jsonl", 60)
    stage(settings, "lost", tmp_path / "prompts.jsonl")
    drop_order(redis_client, "lost", "batch-000001")
    env = base_env(redis_url, store, lease_ttl_s=2, reaper_interval_s=0.5, port=free_port())
    start_worker(env, role="control").wait_ready()
    start_worker(env).wait_ready()
    wait_run_done(settings, redis_client, "lost", 60)
    assert_exactly_once(settings, "lost", ids, redis_client)


@pytest.mark.integration
def test_status_watch_gives_up_when_nothing_works_on_the_run(
    tmp_path: Path, redis_url: str
) -> None:
    """No worker comes: after `wait_deadline_leases` leases with no prompt finished and no
    batch held, `status --watch` exits 1 and says why, instead of waiting forever."""
    store = (tmp_path / "store").as_uri()
    settings = fault_settings(redis_url, store, batch_size=20)
    write_prompts(tmp_path / "prompts.jsonl", 40)
    stage(settings, "idle", tmp_path / "prompts.jsonl")
    env = base_env(redis_url, store, lease_ttl_s=1, wait_deadline_leases=2, startup_timeout_s=1)
    watched = genfleet(["status", "idle", "--watch"], env, timeout_s=60)
    assert watched.returncode == 1, watched.stdout + watched.stderr
    assert watched.stderr.strip(), "it stopped without saying why"
