"""The ledger's state machine, on the test Redis and on the fake (the `db` fixture), and the
rule that nothing else in the package touches a batch's state keys or kombu's unacked hash."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import orjson
import pytest
import redis
from kombu import Connection

from genfleet.common import keys, throughput
from genfleet.common.celery_config import GENERATE_TASK
from genfleet.common.ledger import Ledger, Tally, running_field, work_order_of
from genfleet.common.records import GenerationParams, WorkOrder
from genfleet.common.settings import Settings
from genfleet.producer.broker import make_client_app, send_orders
from harness.env import ROOT

RUN, OTHER = "r", "other"
B0, B1, B2 = (keys.batch_id(i) for i in range(3))


def order(run: str, batch: str) -> dict[str, Any]:
    return WorkOrder(
        run=run,
        batch=batch,
        key=keys.input_key(run, batch),
        params=GenerationParams(max_tokens=8, temperature=0.0, top_p=1.0, thinking=False),
        model="emulator",
        engine="emulator",
        prompts=3,
    ).model_dump(mode="json")


def test_a_claim_is_the_order_as_sent_until_it_is_released(db: Any) -> None:
    ledger = Ledger(db)
    sent = {**order(RUN, B0), "extra": "kept"}
    ledger.claim(sent, "w@a", 12.5)
    ledger.claim(order(RUN, B1), "w@b", 13.0)
    ledger.claim(order(OTHER, B0), "w@c", 14.0)

    (claimed,) = [r for r in ledger.running() if r.field == running_field(RUN, B0)]
    assert (claimed.run, claimed.batch, claimed.worker, claimed.claimed_at) == (
        RUN,
        B0,
        "w@a",
        12.5,
    )
    assert claimed.order() == sent
    assert ledger.running_batches(RUN) == {B0, B1}
    assert ledger.release(RUN, B1) is True
    assert ledger.release(RUN, B1) is False  # a second reaper does not go on
    assert ledger.running_batches(RUN) == {B0}
    assert ledger.forget_running(RUN) == 1
    assert ledger.forget_running(RUN) == 0
    assert [r.field for r in ledger.running()] == [running_field(OTHER, B0)]


def test_the_reaper_takes_over_a_claim_only_while_it_is_the_one_it_read(db: Any) -> None:
    """A slow reaper pass read a dead worker's claim; meanwhile another pass took it over and
    a live worker claimed the batch again: that claim stays, and a claim as read goes."""
    ledger = Ledger(db)
    ledger.claim(order(RUN, B0), "dead@a", 1.0, "genfleet-worker:dead@a")
    (read,) = ledger.running()
    assert read.presence == "genfleet-worker:dead@a"
    assert "presence" not in read.order()
    ledger.claim(order(RUN, B0), "live@b", 2.0)
    assert ledger.release_claim(read) is False
    assert ledger.running_batches(RUN) == {B0}
    (again,) = ledger.running()
    assert ledger.release_claim(again) is True
    assert ledger.release_claim(again) is False
    assert ledger.running_batches(RUN) == set()


def test_queued_marks_follow_enqueue_resume_and_cancel(db: Any) -> None:
    ledger = Ledger(db)
    ledger.mark_queued(RUN, [B0, B1])
    ledger.mark_queued(RUN, [])
    assert ledger.queued(RUN) == {B0, B1}
    assert ledger.queued_count(RUN) == 2
    ledger.set_queued(RUN, {B2})  # what the broker really holds
    assert ledger.queued(RUN) == {B2}
    ledger.set_queued(RUN, set())
    assert ledger.queued_count(RUN) == 0
    ledger.mark_queued(RUN, [B0, B1])
    ledger.unqueue(RUN, {B1})
    ledger.unqueue(RUN, set())
    assert ledger.queued(RUN) == {B0}
    assert ledger.queued(OTHER) == set()


def test_done_clears_queued_and_failed_and_counts_only_with_a_tally(db: Any) -> None:
    ledger = Ledger(db)
    ledger.mark_queued(RUN, [B0, B1])
    ledger.fail(RUN, B0, "EngineDown: gone")
    ledger.mark_queued(RUN, [B0])
    ledger.done(RUN, B0)
    assert (ledger.queued(RUN), ledger.failed(RUN)) == ({B1}, {})
    assert db.hgetall(keys.counters_key(RUN)) == {}
    tally = Tally(errors=1, completion_tokens=40, reasoning_tokens=7, done_at=9.5)
    ledger.done(RUN, B1, tally, prompts=25)
    ledger.done(RUN, B2, Tally(errors=0, completion_tokens=2, reasoning_tokens=0, done_at=10.0))
    assert db.hgetall(keys.counters_key(RUN)) == {
        b"errors": b"1",
        b"completion_tokens": b"42",
        b"reasoning_tokens": b"7",
        b"last_done_at": b"10.0",
        b"prompts_done": b"25",  # the writer counts the prompts; a copy that found it, not
    }
    assert db.hgetall(keys.done_key(RUN)) == {
        B0.encode(): b"0",
        B1.encode(): b"25",
        B2.encode(): b"0",
    }


def test_progress_counts_generated_work_into_expiring_buckets(db: Any) -> None:
    ledger = Ledger(db)
    ledger.progress("w@a", {RUN: (2, 30), "other": (1, 7)}, 1000.0)
    ledger.progress("w@b", {RUN: (1, 10)}, 1005.0)
    ledger.progress("w@b", {RUN: (1, 5)}, 5000.0)
    counters = db.hgetall(keys.counters_key(RUN))
    assert (counters[b"prompts_generated"], counters[b"tokens_generated"]) == (b"4", b"45")
    assert db.hget(keys.counters_key("other"), "tokens_generated") == b"7"
    first = keys.throughput_bucket_key(RUN, throughput.bucket_of(1000.0))
    assert db.hgetall(first) == {b"": b"40", b"w@a": b"30", b"w@b": b"10"}
    later = keys.throughput_bucket_key(RUN, throughput.bucket_of(5000.0))
    assert db.hgetall(later) == {b"": b"5", b"w@b": b"5"}


def test_a_failed_batch_leaves_queued_and_running_with_its_reason(db: Any) -> None:
    ledger = Ledger(db)
    ledger.mark_queued(RUN, [B0])
    ledger.claim(order(RUN, B0), "w@a", 1.0)
    assert [ledger.tried(RUN, B0), ledger.tried(RUN, B0)] == [1, 2]
    ledger.fail(RUN, B0, "X" * 5000)
    assert ledger.failed(RUN) == {B0: "X" * 2000}
    assert (ledger.queued(RUN), ledger.running_batches(RUN)) == (set(), set())


def test_a_parked_batch_has_no_order_and_does_not_run(db: Any) -> None:
    ledger = Ledger(db)
    ledger.mark_queued(RUN, [B0, B1])
    ledger.claim(order(RUN, B0), "w@a", 1.0)
    db.set(keys.cancelled_key(RUN), "1")  # parked only while the run is cancelled
    assert ledger.park(RUN, B0) is True
    assert ledger.queued(RUN) == {B1}
    assert (ledger.running_batches(RUN), ledger.failed(RUN)) == (set(), {})


def test_lost_deliveries_make_poison_and_an_unsent_requeue_is_undone(db: Any) -> None:
    ledger = Ledger(db)
    ledger.mark_queued(RUN, [B0])
    ledger.claim(order(RUN, B0), "w@a", 1.0)
    (claimed,) = ledger.running()
    assert ledger.release(RUN, B0)
    assert ledger.lost(RUN, B0) == 1
    ledger.unlose(claimed)  # the requeue could not be sent
    assert ledger.running() == [claimed]
    assert not ledger.is_poison(RUN, B0, 1)
    assert [ledger.lost(RUN, B0), ledger.lost(RUN, B0)] == [1, 2]
    assert ledger.is_poison(RUN, B0, 2) and not ledger.is_poison(RUN, B0, 3)
    ledger.poison(RUN, B0, "poison batch")
    assert ledger.failed(RUN) == {B0: "poison batch"}
    assert ledger.queued(RUN) == set()
    assert ledger.running() == [claimed]  # the reaper's own release takes the claim, not poison


def test_retry_clears_the_failed_batches_budgets_and_only_theirs(db: Any) -> None:
    ledger = Ledger(db)
    for batch in (B0, B1):
        ledger.mark_queued(RUN, [batch])
        ledger.tried(RUN, batch)
        ledger.lost(RUN, batch)
    ledger.fail(RUN, B0, "EngineDown")
    ledger.mark_queued(RUN, [B0])  # a stale mark: retry must send it again
    assert ledger.clear_failed(RUN) == [B0]
    assert ledger.failed(RUN) == {} and ledger.queued(RUN) == {B1}
    assert db.hgetall(keys.attempts_key(RUN)) == {B1.encode(): b"1"}
    assert db.hgetall(keys.lost_key(RUN)) == {B1.encode(): b"1"}
    assert not ledger.is_poison(RUN, B0, 1) and ledger.is_poison(RUN, B1, 1)
    assert ledger.clear_failed(RUN) == []


def kombu_unacked(db: Any, tag: str, message: dict[str, Any]) -> None:
    """A delivered, unacknowledged message as kombu keeps it on Redis."""
    db.hset(keys.UNACKED, tag, orjson.dumps([message, "", "gpu.emulator"]))
    db.zadd(keys.UNACKED_INDEX, {tag: 1.0})


def task_message(task: str, body: dict[str, Any]) -> dict[str, Any]:
    return {
        "body": orjson.dumps([[], body, {}]).decode(),
        "headers": {"task": task},
        "properties": {},
    }


def test_unacked_orders_are_the_genfleet_work_orders_of_the_hash(db: Any) -> None:
    ledger = Ledger(db)
    kombu_unacked(db, "t0", task_message(GENERATE_TASK, {"order": order(RUN, B0)}))
    kombu_unacked(db, "t1", task_message(GENERATE_TASK, {"order": order(RUN, B0)}))
    kombu_unacked(db, "t2", task_message(GENERATE_TASK, {"order": order(OTHER, B1)}))
    kombu_unacked(db, "t3", task_message("genfleet.power_watch", {}))
    db.hset(keys.UNACKED, "t4", b"not json")
    db.hset(keys.UNACKED, "t5", b"[]")

    assert sorted((u.tag, u.run, u.batch) for u in ledger.unacked_orders()) == [
        ("t0", RUN, B0),
        ("t1", RUN, B0),
        ("t2", OTHER, B1),
    ]
    assert sorted(ledger.unacked_index().copies(RUN, B0)) == ["t0", "t1"]
    ledger.drop_unacked(["t0"])
    ledger.drop_unacked([])
    assert ledger.unacked_index().copies(RUN, B0) == ["t1"]
    assert ledger.purge_unacked(RUN) == {B0}
    assert ledger.purge_unacked(RUN) == set()
    assert sorted(db.hgetall(keys.UNACKED)) == [b"t2", b"t3", b"t4", b"t5"]
    assert db.zrange(keys.UNACKED_INDEX, 0, -1) == [b"t2", b"t3"]


@pytest.mark.integration
def test_the_parser_reads_what_celery_and_kombu_really_put_in_redis(
    redis_url: str, redis_client: redis.Redis
) -> None:
    """A work order sent by the producer, then delivered and not acknowledged, as the worker's
    transport leaves it: the queue's list entry and the unacked hash both parse."""
    settings = Settings(redis_url=redis_url)
    sent = WorkOrder.model_validate(order(RUN, B2))
    assert send_orders(make_client_app(settings), settings, [sent]) == 1
    (waiting,) = redis_client.lrange("gpu.emulator", 0, -1)
    assert work_order_of(waiting) == (RUN, B2)
    with Connection(redis_url) as conn:
        delivered = conn.SimpleQueue("gpu.emulator").get(timeout=5)
        assert Ledger(redis_client).unacked_index().copies(RUN, B2) == [delivered.delivery_tag]
        assert Ledger(redis_client).purge_unacked(RUN) == {B2}
        assert redis_client.hlen(keys.UNACKED) == 0


OWNERS = {Path("common/ledger.py"), Path("common/keys.py")}


def package_files() -> list[Path]:
    """Every module of the package (genfleet/'s links lead to these folders)."""
    found = [p for top in ("common", "producer", "workers") for p in (ROOT / top).rglob("*.py")]
    return sorted(found) + [ROOT / "genfleet" / "cli.py"]


STATE = re.compile(
    r"\b(queued_key|running_key|failed_key|attempts_key|lost_key|delivered_key|UNACKED(_INDEX)?)\b"
    r"|[\"']unacked(_index)?[\"']"
)


def test_no_module_but_the_ledger_touches_a_batchs_state_keys() -> None:
    hits = [
        f"{path}:{number}: {line.strip()}"
        for path in package_files()
        if path.relative_to(ROOT) not in OWNERS
        for number, line in enumerate(path.read_text().splitlines(), 1)
        if STATE.search(line)
    ]
    assert hits == [], "ask common/ledger.py instead:\n" + "\n".join(hits)


def test_the_ownership_check_sees_a_raw_write() -> None:
    assert STATE.search("client.hset(keys.failed_key(run), batch, reason)")
    assert STATE.search('client.hgetall("unacked")')
    assert not STATE.search("visibility_timeout_s re-delivers an unacked batch")
