"""`batch.execute` in process: a real Feeder driving FakeChat, a MemoryStore, a MemoryRedis.

The fakes pass the same contract tests as S3, the file store and Redis
(tests/common/test_store.py, tests/common/test_redis_contract.py). Checked here: the output
object (order, content, written once), the checkpoint parts, the lease, the counters status
reads, and which prompts the engine was asked again on a retry.
"""

from __future__ import annotations

import gzip
import hashlib
import threading
import time
from collections import Counter
from typing import Any

import orjson
import pytest

from genfleet.common import keys, throughput
from genfleet.common.errors import (
    BatchHandedBack,
    BatchInputMismatch,
    BatchSuperseded,
    EngineDown,
    StoreUnavailable,
)
from genfleet.common.records import (
    PromptRecord,
    WorkOrder,
    decode_jsonl_gz,
)
from genfleet.common.routing import ModelRef
from genfleet.producer.runs.identity import claim_run
from genfleet.workers.batch import BatchInputMissing, BatchInterrupted, execute
from harness.waits import meanwhile, wait_for
from tests.fakes.engine import FakeChat
from tests.fakes.memory_redis import MemoryRedis
from tests.fakes.memory_store import MemoryStore
from tests.support.core import (
    BATCH,
    PARAMS,
    RUN,
    MakeFeeder,
    core_order,
    execute_batch,
    output_rows,
    stage_batch,
)


def counters(db: MemoryRedis) -> dict[str, float]:
    return {k.decode(): float(v) for k, v in db.hgetall(keys.counters_key(RUN)).items()}


@pytest.fixture
def db() -> MemoryRedis:
    db = MemoryRedis()
    db.sadd(keys.queued_key(RUN), BATCH)  # the producer's mark: a work order is outstanding
    return db


def test_a_batch_writes_its_output_in_input_order_and_counts_after(
    db: MemoryRedis, feeders: MakeFeeder
) -> None:
    store = MemoryStore()
    order = stage_batch(store, 6)
    chat = FakeChat(tokens=5)
    started = time.time()

    summary = execute_batch(order, store, db, feeders(chat))

    rows = output_rows(store)
    assert [row["id"] for row in rows] == [f"p{i}" for i in range(6)]
    assert [row["content"] for row in rows] == [f"answer to p{i}#0" for i in range(6)]
    assert (summary.prompts, summary.completions, summary.errors, summary.resumed) == (6, 6, 0, 0)
    assert summary.completion_tokens == 30 and summary.finish_reasons == {"stop": 6}
    assert not summary.skipped and not summary.duplicate
    figures = counters(db)
    assert figures["completion_tokens"] == 30 and figures["errors"] == 0
    assert figures["prompts_generated"] == 6 and figures["tokens_generated"] == 30
    assert "started_at" in figures and "last_done_at" in figures
    assert db.smembers(keys.queued_key(RUN)) == set()
    assert db.exists(keys.lease_key(RUN, BATCH)) == 0
    assert list(store.list(keys.parts_prefix(RUN, BATCH))) == []
    # status's tok/s: the run's tokens and this worker's, in the ten-second buckets it ran in
    buckets = range(throughput.bucket_of(started), throughput.bucket_of(time.time()) + 1)
    counted = Counter[bytes]()
    for bucket in buckets:
        for field, value in db.hgetall(keys.throughput_bucket_key(RUN, bucket)).items():
            counted[field] += int(value)
    assert counted == {b"": 30, b"w@test": 30}


def test_a_batch_whose_output_exists_is_skipped_without_asking_the_engine(
    db: MemoryRedis, feeders: MakeFeeder
) -> None:
    store = MemoryStore()
    order = stage_batch(store, 3)
    store.put_if_absent(keys.output_key(RUN, BATCH), b"written by an earlier delivery")
    db.hset(keys.failed_key(RUN), BATCH, "EngineDown: an old failure")
    chat = FakeChat()

    summary = execute_batch(order, store, db, feeders(chat))

    assert summary.skipped and summary.completions == 0
    assert sum(chat.calls.values()) == 0
    assert store.get(keys.output_key(RUN, BATCH)) == b"written by an earlier delivery"
    assert db.smembers(keys.queued_key(RUN)) == set()
    assert db.hgetall(keys.failed_key(RUN)) == {}
    assert "completion_tokens" not in counters(db)  # counted by the delivery that wrote it


def test_a_missing_input_is_permanent(db: MemoryRedis, feeders: MakeFeeder) -> None:
    store = MemoryStore()
    order = stage_batch(store, 3)
    store.delete_prefix(order.key)

    with pytest.raises(BatchInputMissing, match="is missing"):
        execute_batch(order, store, db, feeders(FakeChat()))
    assert not store.exists(keys.output_key(RUN, BATCH))


def test_a_running_batch_checkpoints_and_holds_its_lease(
    db: MemoryRedis, feeders: MakeFeeder
) -> None:
    store = MemoryStore()
    order = stage_batch(store, 4)
    gate = threading.Event()
    chat = FakeChat(gate=gate, ungated={"p0", "p1"})
    feeder = feeders(chat)
    outcome: dict[str, Any] = {}
    thread = threading.Thread(
        target=lambda: outcome.update(
            summary=execute_batch(
                order, store, db, feeder, lease_ttl_s=0.3, checkpoint_interval_s=0
            )
        )
    )
    thread.start()
    try:
        part = wait_for(
            lambda: next(iter(store.list(keys.parts_prefix(RUN, BATCH))), None),
            10,
            "a checkpoint part while two prompts still run",
            0.01,
        )
        assert [row["id"] for row in decode_jsonl_gz(store.get(part) or b"")] == ["p0", "p1"]
        assert db.get(keys.lease_key(RUN, BATCH)) == b"w@test"
        # live progress before the output, within the worker's progress interval
        wait_for(lambda: counters(db).get("prompts_generated") == 2, 10, "live progress", 0.05)
        assert not store.exists(keys.output_key(RUN, BATCH))
    finally:
        gate.set()
        thread.join(timeout=10)

    assert outcome["summary"].completions == 4
    assert [row["id"] for row in output_rows(store)] == ["p0", "p1", "p2", "p3"]
    assert list(store.list(keys.parts_prefix(RUN, BATCH))) == []
    assert db.exists(keys.lease_key(RUN, BATCH)) == 0


def test_a_failed_try_keeps_what_finished_and_the_retry_skips_it(
    db: MemoryRedis, feeders: MakeFeeder
) -> None:
    store = MemoryStore()
    order = stage_batch(store, 5)
    gate = threading.Event()  # never opened: p4 is still running when p3 fails
    chat = FakeChat(
        gate=gate, ungated={"p0", "p1", "p2"}, failures={"p3": [EngineDown("engine gone")]}
    )

    with pytest.raises(EngineDown, match="engine gone"):  # unwrapped from the TaskGroup
        execute_batch(order, store, db, feeders(chat))

    assert chat.cancelled == 1 and chat.inflight == 0  # p4 stopped, not left running
    parts = list(store.list(keys.parts_prefix(RUN, BATCH)))
    kept = sorted(row["id"] for part in parts for row in decode_jsonl_gz(store.get(part) or b""))
    assert kept == ["p0", "p1", "p2"]
    assert db.exists(keys.lease_key(RUN, BATCH)) == 0
    assert not store.exists(keys.output_key(RUN, BATCH))
    assert "completion_tokens" not in counters(db)

    again = FakeChat()
    summary = execute_batch(order, store, db, feeders(again))

    assert (summary.resumed, summary.completions) == (3, 5)
    assert dict(again.calls) == {"p3": 1, "p4": 1}
    assert [row["id"] for row in output_rows(store)] == [f"p{i}" for i in range(5)]
    assert counters(db)["completion_tokens"] == 35  # the whole batch, counted once
    assert list(store.list(keys.parts_prefix(RUN, BATCH))) == []


def test_a_cancelled_batch_is_interrupted_with_its_finished_prompts_checkpointed(
    db: MemoryRedis, feeders: MakeFeeder
) -> None:
    store = MemoryStore()
    order = stage_batch(store, 6)
    gate = threading.Event()
    chat = FakeChat(gate=gate, ungated={"p0", "p1"})
    feeder = feeders(chat)

    shut_down = meanwhile(lambda: chat.inflight == 4, feeder.cancel_all, "four in flight")
    with pytest.raises(BatchInterrupted, match="after 2 of 6 prompts"):
        execute_batch(order, store, db, feeder)
    shut_down()
    gate.set()

    parts = list(store.list(keys.parts_prefix(RUN, BATCH)))
    kept = sorted(row["id"] for part in parts for row in decode_jsonl_gz(store.get(part) or b""))
    assert kept == ["p0", "p1"]
    assert not store.exists(keys.output_key(RUN, BATCH))
    assert db.exists(keys.lease_key(RUN, BATCH)) == 0


def test_a_batch_handed_back_keeps_what_finished_and_its_next_try_sends_only_the_rest(
    db: MemoryRedis, feeders: MakeFeeder
) -> None:
    """The worker's engine restarts with no order waiting: the batch goes back to the queue
    at its next tick, as a shutdown sends it, with the reason; nothing is written as done."""
    store = MemoryStore()
    order = stage_batch(store, 6)
    gate = threading.Event()
    chat = FakeChat(gate=gate, ungated={"p0", "p1"})
    asked: list[int] = []

    def handing_back() -> str | None:
        asked.append(chat.inflight)
        return "its engine is restarting" if chat.inflight == 4 else None

    with pytest.raises(BatchHandedBack, match="after 2 of 6 prompts.*its engine is restarting"):
        execute(
            order,
            store=store,
            client=db,
            feeder=feeders(chat),
            worker="w@test",
            lease_ttl_s=30,
            checkpoint_interval_s=60,
            handing_back=handing_back,
        )
    gate.set()

    assert asked  # asked at its ticks, not only once at the start
    assert chat.cancelled == 4 and chat.inflight == 0  # its requests stopped, not left running
    parts = list(store.list(keys.parts_prefix(RUN, BATCH)))
    kept = sorted(row["id"] for part in parts for row in decode_jsonl_gz(store.get(part) or b""))
    assert kept == ["p0", "p1"]
    assert not store.exists(keys.output_key(RUN, BATCH))
    assert db.exists(keys.lease_key(RUN, BATCH)) == 0

    again = FakeChat()
    summary = execute_batch(order, store, db, feeders(again))
    assert (summary.resumed, summary.completions) == (2, 6)
    assert dict(again.calls) == {f"p{i}": 1 for i in range(2, 6)}


class LostRace(MemoryStore):
    """A store where another copy of the batch writes the output between check and put."""

    def put_if_absent(self, key: str, data: bytes) -> bool:
        if key == keys.output_key(RUN, BATCH):
            super().put_if_absent(key, b"the other copy's output")
        return super().put_if_absent(key, data)


def test_a_duplicate_delivery_that_loses_the_race_counts_nothing(
    db: MemoryRedis, feeders: MakeFeeder
) -> None:
    store = LostRace()
    order = stage_batch(store, 3)

    summary = execute_batch(order, store, db, feeders(FakeChat()))

    assert summary.duplicate and summary.completions == 3
    assert store.get(keys.output_key(RUN, BATCH)) == b"the other copy's output"
    figures = counters(db)
    assert "completion_tokens" not in figures  # the winner counts the batch, not this copy
    assert figures["prompts_generated"] == 3  # the GPU work was done all the same
    # ... and thrown away: the run says so (common/waste.py's late copies)
    assert figures["waste_late_copies"] == 1
    assert figures["waste_late_copy_tokens"] == summary.generated_tokens > 0
    assert db.smembers(keys.queued_key(RUN)) == set()


class PartsStuck(MemoryStore):
    """Deleting checkpoint parts fails (S3 gone right after the output put)."""

    def delete_prefix(self, prefix: str) -> int:
        raise StoreUnavailable("S3 delete failed after 6 tries")


def test_a_batch_counts_even_when_its_parts_cannot_be_deleted(
    db: MemoryRedis, feeders: MakeFeeder
) -> None:
    store = PartsStuck()
    order = stage_batch(store, 3)

    summary = execute_batch(order, store, db, feeders(FakeChat()))

    assert summary.completions == 3 and store.exists(keys.output_key(RUN, BATCH))
    assert counters(db)["completion_tokens"] == 21


def test_a_confirmed_output_marks_the_batch_done_and_counts_its_prompts_once(
    db: MemoryRedis, feeders: MakeFeeder
) -> None:
    """The progress copy `status` reads (common/progress.py): the writer adds the batch and
    its prompts; a later delivery that finds the output marks it done without counting again."""
    store = MemoryStore()
    order = stage_batch(store, 4)

    execute_batch(order, store, db, feeders(FakeChat()))
    execute_batch(order, store, db, feeders(FakeChat()))  # a duplicate delivery: skipped

    assert db.hgetall(keys.done_key(RUN)) == {BATCH.encode(): b"4"}
    assert counters(db)["prompts_done"] == 4


SCHEMA_FORMAT = {
    "type": "json_schema",
    "json_schema": {"name": "answer", "schema": {"type": "object", "required": ["a"]}},
}


def schema_order(store: MemoryStore, count: int) -> WorkOrder:
    """An order as the producer sends it for a run with `--json-schema`: the schema stored
    once, the order naming it."""
    from genfleet.producer.enqueue import _order, store_response_format

    base = stage_batch(store, count)
    params = base.params.model_copy(update={"response_format": SCHEMA_FORMAT})
    stored = store_response_format(store, RUN, params)
    ref = ModelRef("emulator", "emulator")
    return _order(
        RUN,
        BATCH,
        count,
        params,
        ref,
        sha256=base.input_sha256,
        staging=base.staging,
        stored=stored,
    )


def test_an_order_names_the_runs_schema_and_the_engine_gets_it(
    db: MemoryRedis, feeders: MakeFeeder
) -> None:
    store = MemoryStore()
    order = schema_order(store, 3)
    assert order.params.response_format is None
    assert "required" not in order.model_dump_json()  # the schema is not in the message
    chat = FakeChat()

    execute_batch(order, store, db, feeders(chat))

    assert [p.response_format for p in chat.params] == [SCHEMA_FORMAT] * 3


def test_a_schema_that_is_not_the_one_the_order_names_is_never_sent(
    db: MemoryRedis, feeders: MakeFeeder
) -> None:
    store = MemoryStore()
    order = schema_order(store, 3)
    assert order.response_format_key is not None
    store.put(order.response_format_key, b'{"type": "json_object"}')  # replaced under it
    chat = FakeChat()

    with pytest.raises(BatchInputMissing, match="not the one"):
        execute_batch(order, store, db, feeders(chat))
    assert sum(chat.calls.values()) == 0


def staged_order(
    store: MemoryStore, texts: list[str], hashed: bool = False, staging: str | None = None
) -> WorkOrder:
    """Stage prompts p0.. with `texts`; their order, carrying (`hashed`) the staged content's
    hash as the producer computes it and the `staging` id, when asked."""
    bound: dict[str, str] = {} if staging is None else {"staging": staging}
    records = [
        PromptRecord(id=f"p{i}", messages=[{"role": "user", "content": text}])
        for i, text in enumerate(texts)
    ]
    lines = [orjson.dumps(r.to_json()) for r in records]
    store.put(keys.input_key(RUN, BATCH), gzip.compress(b"".join(x + b"\n" for x in lines)))
    if hashed:  # sha256 over the lines' sha256s, newline-joined
        each = "\n".join(hashlib.sha256(line).hexdigest() for line in lines)
        bound["input_sha256"] = hashlib.sha256(each.encode()).hexdigest()
    return core_order(prompts=len(records)).model_copy(update=bound)


def claim(store: MemoryStore) -> str:
    """Claim the run as the producer does; returns its staging id."""
    return claim_run(store, RUN, PARAMS, ModelRef("emulator", "emulator"), {}, "f", "src")


def test_a_checkpoint_of_another_prompt_under_the_same_id_is_not_kept(
    db: MemoryRedis, feeders: MakeFeeder
) -> None:
    store = MemoryStore()
    # p0..p2 asking q0..q2; the try fails after p0 and p1 are checkpointed
    failing = FakeChat(failures={"p2": [EngineDown("engine gone")]})
    with pytest.raises(EngineDown):
        execute_batch(stage_batch(store, 3), store, db, feeders(failing))
    assert list(store.list(keys.parts_prefix(RUN, BATCH)))
    # The same batch staged again with p1 edited (an interrupted staging finished with
    # other data): p1's checkpoint answers the old question and must not stand for the new.
    order = staged_order(store, ["q0", "q1, edited", "q2"])
    again = FakeChat()

    summary = execute_batch(order, store, db, feeders(again))

    assert dict(again.calls) == {"p1": 1, "p2": 1} and summary.resumed == 1
    rows = output_rows(store)
    assert [row["messages"][0]["content"] for row in rows] == ["q0", "q1, edited", "q2"]
    assert all(row["prompt_sha256"] for row in rows)


def test_an_input_that_is_not_the_orders_is_refused(db: MemoryRedis, feeders: MakeFeeder) -> None:
    store = MemoryStore()
    order = staged_order(store, ["q0", "q1"], hashed=True)
    staged_order(store, ["q0", "other"])  # the input object now holds other prompts
    chat = FakeChat()

    with pytest.raises(BatchInputMismatch, match="is not the one"):
        execute_batch(order, store, db, feeders(chat))
    assert sum(chat.calls.values()) == 0
    assert not store.exists(keys.output_key(RUN, BATCH))


def test_a_batch_whose_run_is_deleted_and_staged_anew_while_it_runs_writes_nothing(
    db: MemoryRedis, feeders: MakeFeeder
) -> None:
    store = MemoryStore()
    order = staged_order(store, ["q0", "q1", "q2"], hashed=True, staging=claim(store))
    gate = threading.Event()
    chat = FakeChat(gate=gate, ungated={"p0"})
    feeder = feeders(chat)
    outcome: list[BaseException] = []

    def go() -> None:
        try:
            execute_batch(order, store, db, feeder, checkpoint_interval_s=0)
        except BaseException as exc:  # noqa: BLE001 - the test reads it
            outcome.append(exc)

    thread = threading.Thread(target=go)
    thread.start()
    wait_for(lambda: chat.inflight == 2, 10, "two prompts running")
    # `genfleet delete` then a new staging of the same data under the same name: another
    # staging id (whatever any clock says).
    store.delete_prefix(f"{RUN}/")
    again = staged_order(store, ["q0", "q1", "q2"], hashed=True, staging=claim(store))
    assert again.staging != order.staging
    gate.set()
    thread.join(timeout=10)

    assert [type(exc) for exc in outcome] == [BatchSuperseded]
    assert not store.exists(keys.output_key(RUN, BATCH))
    assert list(store.list(keys.parts_prefix(RUN, BATCH))) == []
