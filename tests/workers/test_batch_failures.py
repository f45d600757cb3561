"""How one try of a batch fails: the error the task sees, what is kept, what is counted.

`execute` runs against a real Redis and a file store, with a stand-in feeder that finishes
some prompts and then fails the way the real one does (its TaskGroup raises an
ExceptionGroup).
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Iterable
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import orjson
import pytest
import redis

from genfleet.common import keys
from genfleet.common.errors import EngineDown, StoreUnavailable
from genfleet.common.records import (
    CompletionRecord,
    GenerationParams,
    PromptRecord,
    WorkOrder,
    decode_jsonl_gz,
    encode_jsonl_gz,
)
from genfleet.common.store import FileStore
from genfleet.workers import checkpoint
from genfleet.workers.batch import _InFlight, execute
from genfleet.workers.feeding import Drawn
from tests.support.core import PARAMS

pytestmark = pytest.mark.integration


class StubFeeder:
    """Finishes the first `finish` prompts of a batch, then fails with `error` (or succeeds)."""

    def __init__(self, finish: int, error: BaseException | None) -> None:
        self.finish = finish
        self.error = error
        self.future: Future[None] = Future()

    def run_batch(
        self,
        run: str,
        batch: str,
        records: Iterable[PromptRecord],
        params: GenerationParams,
        on_record: Callable[[int, CompletionRecord], None],
        on_sent: Callable[[], None] | None = None,
        drawn: dict[tuple[str, int], Drawn] | None = None,
    ) -> Future[None]:
        self.drawn = drawn or {}
        for index, record in enumerate(list(records)[: self.finish]):
            on_record(index, completion(run, batch, record))
        if self.error is None:
            self.future.set_result(None)
        else:
            self.future.set_exception(self.error)
        return self.future

    def read_live(
        self, run: str, batch: str, read: Callable[[dict[tuple[str, int], Drawn]], Any]
    ) -> Any:
        return read({})  # answers drawn by the chat endpoint only: none is kept in flight


def completion(run: str, batch: str, record: PromptRecord) -> CompletionRecord:
    return CompletionRecord(
        id=record.id,
        run=run,
        batch=batch,
        messages=record.messages,
        reasoning=None,
        content="ok",
        finish_reason="stop",
    )


def staged(store: FileStore, count: int) -> WorkOrder:
    records = [
        PromptRecord(id=f"p{i}", messages=[{"role": "user", "content": f"q{i}"}])
        for i in range(count)
    ]
    key = keys.input_key("r", "batch-000000")
    store.put(key, encode_jsonl_gz(r.to_json() for r in records))
    return WorkOrder(
        run="r",
        batch="batch-000000",
        key=key,
        params=PARAMS,
        model="emulator",
        engine="emulator",
        prompts=count,
    )


def run(order: WorkOrder, store: Any, client: redis.Redis, feeder: StubFeeder) -> Any:
    return execute(
        order,
        store=store,
        client=client,
        feeder=feeder,  # type: ignore[arg-type]
        worker="w@test",
        lease_ttl_s=5,
        checkpoint_interval_s=60,
    )


def test_a_failed_try_raises_the_error_inside_the_group_and_keeps_what_finished(
    tmp_path: Path, redis_client: redis.Redis
) -> None:
    store = FileStore(tmp_path)
    order = staged(store, 4)
    group = ExceptionGroup("unhandled errors in a TaskGroup", [EngineDown("engine down")])
    feeder = StubFeeder(finish=2, error=group)

    with pytest.raises(EngineDown, match="engine down"):
        run(order, store, redis_client, feeder)

    parts = list(store.list(keys.parts_prefix("r", "batch-000000")))
    assert len(parts) == 1
    kept = [row["id"] for row in decode_jsonl_gz(store.get(parts[0]) or b"")]
    assert kept == ["p0", "p1"]
    assert not redis_client.exists(keys.lease_key("r", "batch-000000"))
    assert not store.exists(keys.output_key("r", "batch-000000"))


def test_the_retry_skips_checkpointed_prompts(tmp_path: Path, redis_client: redis.Redis) -> None:
    store = FileStore(tmp_path)
    order = staged(store, 4)
    with pytest.raises(EngineDown):
        run(order, store, redis_client, StubFeeder(2, ExceptionGroup("g", [EngineDown("x")])))

    summary = run(order, store, redis_client, StubFeeder(finish=2, error=None))

    assert (summary.resumed, summary.completions) == (2, 4)
    rows = list(decode_jsonl_gz(store.get(keys.output_key("r", "batch-000000")) or b""))
    assert [row["id"] for row in rows] == ["p0", "p1", "p2", "p3"]


class PartsStuck(FileStore):
    """A store where deleting checkpoint parts fails (S3 gone right after the output put)."""

    def delete_prefix(self, prefix: str) -> int:
        raise StoreUnavailable("S3 delete failed after 6 tries")


def test_a_batch_is_counted_even_when_its_parts_cannot_be_deleted(
    tmp_path: Path, redis_client: redis.Redis
) -> None:
    store = PartsStuck(tmp_path)
    order = staged(store, 3)

    summary = run(order, store, redis_client, StubFeeder(finish=3, error=None))

    assert summary.completions == 3 and not summary.duplicate
    assert store.exists(keys.output_key("r", "batch-000000"))
    counters = redis_client.hgetall(keys.counters_key("r"))
    assert b"last_done_at" in counters and int(counters[b"errors"]) == 0  # counted once
    assert int(counters[b"prompts_generated"]) == 3


def test_an_aborted_answer_in_a_checkpoint_is_sent_again_not_kept(
    tmp_path: Path, redis_client: redis.Redis
) -> None:
    store = FileStore(tmp_path)
    order = staged(store, 3)
    aborted = completion(
        "r", "batch-000000", PromptRecord("p1", [{"role": "user", "content": "q1"}])
    )
    aborted.finish_reason = "abort"
    p0 = PromptRecord("p0", [{"role": "user", "content": "q0"}])
    kept = completion("r", "batch-000000", p0)
    kept.prompt_sha256 = hashlib.sha256(orjson.dumps(p0.to_json())).hexdigest()  # as staged
    store.put(
        keys.part_key("r", "batch-000000", 0),
        encode_jsonl_gz([kept.to_json(), aborted.to_json()]),
    )
    feeder = StubFeeder(finish=3, error=None)

    summary = run(order, store, redis_client, feeder)

    assert (summary.resumed, summary.completions) == (1, 3)
    rows = list(decode_jsonl_gz(store.get(keys.output_key("r", "batch-000000")) or b""))
    assert [row["finish_reason"] for row in rows] == ["stop", "stop", "stop"]


def test_answers_kept_in_flight_go_to_the_next_try_for_their_own_prompt_only(
    tmp_path: Path, redis_client: redis.Redis
) -> None:
    """A checkpoint row of an answer in flight (drawn by ids) reaches the feeder for the
    staged prompt whose digest it names, the longest of its copies; a row naming another
    digest (a run staged anew under the same ids) and one of a finished prompt do not."""
    store = FileStore(tmp_path)
    order = staged(store, 3)

    def digest(i: int) -> str:
        record = PromptRecord(f"p{i}", [{"role": "user", "content": f"q{i}"}])
        return hashlib.sha256(orjson.dumps(record.to_json())).hexdigest()

    def drawn(ids: list[int]) -> dict[str, Any]:
        answer = Drawn(in_reasoning=True)
        answer.add(ids, "x" * len(ids))
        return answer.to_json()

    p2 = PromptRecord("p2", [{"role": "user", "content": "q2"}])
    finished = completion("r", "batch-000000", p2)
    finished.prompt_sha256 = digest(2)
    rows = [
        {"id": "p0", "sample": 0, "prompt_sha256": digest(0), "drawn": drawn([1, 2])},
        {"id": "p0", "sample": 0, "prompt_sha256": digest(0), "drawn": drawn([1, 2, 3])},
        {"id": "p1", "sample": 0, "prompt_sha256": "0" * 64, "drawn": drawn([4])},
        {"id": "p2", "sample": 0, "prompt_sha256": digest(2), "drawn": drawn([5])},
        finished.to_json(),
    ]
    store.put(keys.part_key("r", "batch-000000", 0), encode_jsonl_gz(rows))
    feeder = StubFeeder(finish=3, error=None)

    summary = run(order, store, redis_client, feeder)

    assert set(feeder.drawn) == {("p0", 0)}
    assert list(feeder.drawn[("p0", 0)].ids) == [1, 2, 3]
    assert (summary.resumed, summary.completions) == (1, 3)


class InFlightFeeder(StubFeeder):
    """Its batch's answers in flight grow by `step` ids between two looks."""

    def __init__(self, step: int) -> None:
        super().__init__(finish=0, error=None)
        self.step, self.looks = step, 0

    def read_live(
        self, run: str, batch: str, read: Callable[[dict[tuple[str, int], Drawn]], Any]
    ) -> Any:
        self.looks += 1
        live = {}
        for i in range(3):
            answer = Drawn(in_reasoning=False)
            answer.add(list(range(self.looks * self.step)), "x")
            live[(f"p{i}", 0)] = answer
        return read(live)


def test_a_batch_keeps_one_copy_of_its_answers_in_flight_not_one_per_interval(
    tmp_path: Path,
) -> None:
    """Each copy holds every answer in flight, so the one before is deleted once the answers
    finished since are in the store; while they are not, the older copy stays."""
    store = FileStore(tmp_path)
    order = staged(store, 3)
    digests = {(f"p{i}", 0): "0" * 64 for i in range(3)}
    in_flight = _InFlight(InFlightFeeder(step=4), order, digests)  # type: ignore[arg-type]
    parts = keys.parts_prefix("r", "batch-000000")

    part = in_flight.save(store, 0, drop_previous=True)
    part = in_flight.save(store, part, drop_previous=True)
    part = in_flight.save(store, part, drop_previous=True)
    assert len(list(store.list(parts))) == 1
    part = in_flight.save(store, part, drop_previous=False)  # a results part failed meanwhile
    assert len(list(store.list(parts))) == 2

    _, _, kept = checkpoint.load_parts(store, "r", "batch-000000")
    longest = {
        key: max(len(r["drawn"]["ids"]) for r in rows.values()) for key, rows in kept.items()
    }
    assert longest == {("p0", 0): 16, ("p1", 0): 16, ("p2", 0): 16}
