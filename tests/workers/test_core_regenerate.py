"""A `--regenerate` batch in the worker: old answers never reach the engine, come back on the
output records, and order the batch (longest-expected prompt first)."""

from __future__ import annotations

from genfleet.common.records import PromptRecord, WorkOrder, encode_jsonl_gz
from tests.fakes.engine import FakeChat
from tests.fakes.memory_redis import MemoryRedis
from tests.fakes.memory_store import MemoryStore
from tests.support.core import MakeFeeder, core_order, execute_batch, output_rows

# (id, old answer's content or None): hints of 3, 1, none, 250 and 25 tokens
OLD = [("a", "x" * 12), ("b", "OK."), ("c", None), ("d", "y" * 1000), ("e", "z" * 100)]


def stage(store: MemoryStore) -> WorkOrder:
    records = [
        PromptRecord(
            id=name,
            messages=[{"role": "user", "content": f"question {name}"}],
            previous=None if old is None else {"content": old, "reasoning": "old thoughts"},
        )
        for name, old in OLD
    ]
    order = core_order(prompts=len(records))
    store.put(order.key, encode_jsonl_gz(r.to_json() for r in records))
    return order


def test_old_answers_never_reach_the_engine_and_come_back_on_the_records(
    feeders: MakeFeeder,
) -> None:
    store, db, chat = MemoryStore(), MemoryRedis(), FakeChat()
    order = stage(store)
    # One request at a time, so the order the engine is asked in is the batch's send order.
    execute_batch(order, store, db, feeders(chat, max_inflight=1))
    assert [r.id for r in chat.sent] == ["d", "e", "a", "b", "c"]  # longest-expected first
    assert all(r.previous is None for r in chat.sent)
    assert all(r.messages == [{"role": "user", "content": f"question {r.id}"}] for r in chat.sent)
    rows = output_rows(store)
    assert [row["id"] for row in rows] == [name for name, _ in OLD]  # output in input order
    for row, (_, old) in zip(rows, OLD, strict=True):
        assert row["content"] == f"answer to {row['id']}#0"
        if old is None:
            assert "previous" not in row
        else:
            assert row["previous"] == {"content": old, "reasoning": "old thoughts"}
