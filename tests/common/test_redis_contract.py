"""The Redis commands of the batch path (`RedisCommands`), on a real server and on the fake.

Every test runs twice: against the test Redis database and against tests/fakes' MemoryRedis
(the `db` fixture, tests/conftest.py), so the unit tests that use the fake
(tests/workers/test_core_*.py) rest on behaviour the real server has. Replies are compared
as a default `redis.Redis` returns them (bytes).
"""

from __future__ import annotations

import time
from typing import Any

import pytest
import redis

from genfleet.common import counters, keys
from genfleet.common.ledger import Ledger, Tally
from genfleet.common.redis_conn import server_time
from harness.waits import wait_for


def test_set_with_px_expires(db: Any) -> None:
    assert db.set("lease", "w@host", px=60_000)
    assert db.exists("lease") == 1
    assert db.get("lease") == b"w@host"
    assert db.set("short", "w", px=100)
    wait_for(lambda: db.exists("short") == 0, 5, "a 100 ms key to expire", 0.02)
    assert db.exists("lease", "short", "never") == 1
    assert db.delete("lease", "never") == 1
    assert db.exists("lease") == 0


def test_pexpire_sets_an_expiry_on_a_hash_that_exists(db: Any) -> None:
    pipe = db.pipeline()
    pipe.hincrby("bucket", "", 5)
    pipe.pexpire("bucket", 100)
    pipe.pexpire("no such key", 100)
    assert pipe.execute() == [5, True, False]
    assert db.hget("bucket", "") == b"5"
    wait_for(lambda: db.exists("bucket") == 0, 5, "a 100 ms hash to expire", 0.02)


def test_append_grows_a_string_and_keeps_its_expiry(db: Any) -> None:
    pipe = db.pipeline()
    pipe.append("journal", b"one\n")
    pipe.pexpire("journal", 60_000)
    pipe.append("journal", "two\n")
    assert pipe.execute() == [4, True, 8]
    assert db.get("journal") == b"one\ntwo\n"
    assert db.append("journal", b"") == 8
    db.pexpire("journal", 100)
    db.append("journal", b"three\n")  # an APPEND does not clear the expiry
    wait_for(lambda: db.exists("journal") == 0, 5, "an appended key to expire", 0.02)
    db.hset("h", "f", "v")
    with pytest.raises(redis.ResponseError):
        db.append("h", b"x")  # WRONGTYPE
    pipe = db.pipeline()
    pipe.append("gone", b"x")
    pipe.delete("gone", "h")
    assert pipe.execute() == [1, 2]
    assert db.exists("gone", "h") == 0


def test_set_nx_sets_only_a_key_that_is_not_there(db: Any) -> None:
    assert db.set("flag", "1", nx=True)
    assert not db.set("flag", "2", nx=True)
    assert db.get("flag") == b"1"


def test_set_overwrites_and_drops_an_old_expiry(db: Any) -> None:
    db.set("k", "a", px=100)
    db.set("k", 1.5)
    assert db.get("k") == b"1.5"
    with pytest.raises(redis.ResponseError):
        db.hset("k", "f", "v")  # WRONGTYPE


def test_hashes(db: Any) -> None:
    assert db.hset("h", "a", b"\x00bytes") == 1
    assert db.hset("h", "a", "text") == 0
    assert db.hsetnx("h", "a", "other") in (0, False)
    assert db.hsetnx("h", "b", 12.5) in (1, True)
    assert db.hincrby("h", "n", 3) == 3
    assert db.hincrby("h", "n", 4) == 7
    assert db.hget("h", "n") == b"7"
    assert db.hgetall("h") == {b"a": b"text", b"b": b"12.5", b"n": b"7"}
    assert sorted(db.hkeys("h")) == [b"a", b"b", b"n"]
    assert db.hlen("h") == 3
    assert sorted(db.hscan_iter("h", count=2)) == [(b"a", b"text"), (b"b", b"12.5"), (b"n", b"7")]
    with pytest.raises(redis.ResponseError):
        db.hincrby("h", "a", 1)  # not an integer
    assert db.hdel("h", "a", "b", "missing") == 2
    assert db.hdel("h", "n") == 1
    assert db.exists("h") == 0  # an emptied hash is gone
    assert db.hgetall("h") == {}
    assert db.hkeys("h") == []
    assert db.hdel("nothing", "a") == 0


def test_sets(db: Any) -> None:
    assert db.sadd("s", "batch-000001", "batch-000002") == 2
    assert db.sadd("s", "batch-000001") == 0
    assert db.srem("s", "batch-000001", "batch-000009") == 1
    assert db.smembers("s") == {b"batch-000002"}
    assert db.scard("s") == 1
    assert db.srem("missing", "x") == 0
    assert db.scard("missing") == 0


def test_sorted_sets(db: Any) -> None:
    assert db.zadd("z", {"a": 1.0, "b": 5.0, "c": 10.0}) == 3
    assert db.zadd("z", {"a": 2.0}) == 0
    assert db.zremrangebyscore("z", "-inf", 5.0) == 2
    assert db.zrange("z", 0, -1, withscores=True) == [(b"c", 10.0)]


def test_a_pipeline_runs_its_commands_together(db: Any) -> None:
    db.sadd("queued", "batch-000001")
    pipe = db.pipeline()
    pipe.srem("queued", "batch-000001")
    pipe.hdel("failed", "batch-000001")
    pipe.hincrby("counters", "errors", 2)
    pipe.hset("counters", "last_done_at", 12.5)
    pipe.zadd("tput", {"m": 1.0})
    pipe.zremrangebyscore("tput", "-inf", 0.5)
    assert db.hgetall("counters") == {}  # nothing ran yet
    assert pipe.execute() == [1, 0, 2, 1, 1, 0]
    assert db.hgetall("counters") == {b"errors": b"2", b"last_done_at": b"12.5"}
    assert db.smembers("queued") == set()


def test_a_failing_command_in_a_pipeline_does_not_stop_the_others(db: Any) -> None:
    db.set("str", "x")
    pipe = db.pipeline()
    pipe.hset("str", "f", "v")
    pipe.hset("h", "f", "v")
    with pytest.raises(redis.ResponseError):
        pipe.execute()
    assert db.hgetall("h") == {b"f": b"v"}


def test_park_happens_only_while_the_run_is_cancelled_or_deleted(db: Any) -> None:
    ledger = Ledger(db)
    ledger.mark_queued("r", ["b0", "b1"])
    ledger.claim({"run": "r", "batch": "b0"}, "w@h", 1.0)
    assert ledger.park("r", "b0") is False  # resumed (no flag): nothing changes
    assert ledger.queued("r") == {"b0", "b1"} and db.hlen(keys.running_key()) == 1
    db.set(keys.cancelled_key("r"), "1")
    assert ledger.park("r", "b0") is True
    assert ledger.queued("r") == {"b1"} and db.hlen(keys.running_key()) == 0
    db.delete(keys.cancelled_key("r"))
    db.set(keys.deleted_key("r"), "staging-1")
    assert ledger.park("r", "b1") is True
    assert ledger.queued("r") == set()


def test_a_superseded_delivery_releases_only_its_own_stagings_claim(db: Any) -> None:
    ledger = Ledger(db)
    ledger.claim({"run": "r", "batch": "b0", "staging": "new"}, "w2@h", 2.0)
    assert ledger.release_staging("r", "b0", "old") is False
    assert db.hlen(keys.running_key()) == 1  # the new staging's claim stays for the reaper
    assert ledger.release_staging("r", "b0", "new") is True
    assert db.hlen(keys.running_key()) == 0
    ledger.claim({"run": "r", "batch": "b1"}, "w1@h", 1.0)  # an order that names no staging
    assert ledger.release_staging("r", "b1", "old") is True
    assert ledger.release_staging("r", "b1", "old") is False  # gone already


def test_a_batch_found_written_is_counted_once_unless_its_writer_counted_it(db: Any) -> None:
    ledger = Ledger(db)
    ledger.mark_queued("r", ["b0", "b1"])
    ledger.done("r", "b0", Tally(0, 20, 5, 1.0), prompts=5)  # its writer counted it
    assert ledger.found_written("r", "b0", 5) is False
    assert ledger.found_written("r", "b1", 7) is True  # its writer was lost before counting
    assert ledger.found_written("r", "b1", 7) is False  # once
    assert db.hgetall(keys.done_key("r")) == {b"b0": b"5", b"b1": b"7"}
    assert counters.prompts_done(db, "r") == 12 and ledger.queued("r") == set()


def test_a_set_scanned_in_steps_gives_every_member(db: Any) -> None:
    db.sadd("s", *[f"m{i}" for i in range(2500)])
    assert {bytes(m) for m in db.sscan_iter("s", count=100)} == {
        f"m{i}".encode() for i in range(2500)
    }
    assert list(db.sscan_iter("none", count=10)) == []


def test_time_is_the_servers_wall_clock_in_seconds(db: Any) -> None:
    seconds, micros = db.time()
    assert 0 <= int(micros) < 1_000_000
    # The server runs on this machine here: its clock is this one.
    assert abs(server_time(db) - time.time()) < 5
