"""Old answers as length hints: batches sized by expected work, the longest-expected sent first,
ids still the batches' input order."""

from __future__ import annotations

from pathlib import Path

import orjson

from genfleet.common.manifest import Manifest
from genfleet.common.readers import ReaderOptions
from genfleet.common.records import PromptRecord, WorkOrder
from genfleet.common.settings import Settings
from genfleet.producer import enqueue
from genfleet.producer.batching import hinted_tokens, make_batches
from tests.fakes.memory_store import MemoryStore


def record(i: int, hint_chars: int | None) -> PromptRecord:
    previous = None if hint_chars is None else {"content": "x" * hint_chars, "reasoning": None}
    return PromptRecord(f"p{i}", [{"role": "user", "content": "q"}], previous=previous)


def test_hinted_tokens_are_the_old_answer_at_most_max_tokens() -> None:
    assert hinted_tokens(record(0, None), 100) is None
    assert hinted_tokens(record(0, 3), 100) == 1
    assert hinted_tokens(record(0, 400), 100) == 100
    reasoning = PromptRecord("r", [], previous={"content": "ab", "reasoning": "x" * 38})
    assert hinted_tokens(reasoning, 100) == 10


def test_batches_are_cut_by_hinted_work() -> None:
    # 8 short prompts, then 8 prompts four times as long: at batch_size 4, the long ones go
    # in batches of one or two, the short ones in full batches.
    records = [record(i, 40) for i in range(8)] + [record(8 + i, 160) for i in range(8)]
    sizes = [len(b) for b in make_batches(records, 4, 10**9, 1000)]
    assert sizes[:2] == [4, 4]
    assert all(size <= 2 for size in sizes[2:]) and sum(sizes) == 16
    assert [r.id for b in make_batches(records, 4, 10**9, 1000) for r in b] == [
        r.id for r in records
    ]
    plain = [record(i, None) for i in range(16)]
    assert [len(b) for b in make_batches(plain, 4, 10**9, 1000)] == [4, 4, 4, 4]


def write_source(path: Path, hints: list[int]) -> Path:
    rows = [
        {"id": f"q{i}", "conversations": [
            {"from": "human", "value": f"question {i}"}, {"from": "gpt", "value": "x" * chars}]}
        for i, chars in enumerate(hints)
    ]  # fmt: skip
    path.write_bytes(b"".join(orjson.dumps(r) + b"\n" for r in rows))
    return path


def stage(
    tmp_path: Path, hints: list[int], store: MemoryStore | None = None
) -> tuple[Manifest, list[WorkOrder]]:
    settings = Settings(batch_size=1, regenerate=True, store=str(tmp_path / "unused"))
    sent: list[WorkOrder] = []

    def send(orders: list[WorkOrder]) -> int:
        sent.extend(orders)
        return len(orders)

    source = write_source(tmp_path / "d.jsonl", hints)
    options = ReaderOptions(regenerate=True)
    store = MemoryStore() if store is None else store
    manifest, _ = enqueue.stage(settings, store, "r", str(source), options, send, set())
    return manifest, sent


def test_the_longest_hinted_batches_go_out_first(tmp_path: Path) -> None:
    hints = [40, 400, 4, 4000, 400, 40]
    store = MemoryStore()
    manifest, sent = stage(tmp_path, hints, store)
    assert manifest.batch_ids() == [f"batch-{i:06d}" for i in range(6)]  # ids: input order
    assert [e.longest_hint_tokens for e in manifest.entries(store)] == [h // 4 for h in hints]
    # The first at once; then, holding half of those staged, the longest waiting goes on; at
    # the end the held ones, longest first.
    assert [o.batch for o in sent] == [
        "batch-000000", "batch-000001", "batch-000003", "batch-000004", "batch-000005",
        "batch-000002",
    ]  # fmt: skip


def test_past_the_held_window_the_longest_waiting_goes_on(tmp_path: Path) -> None:
    hints = [(i * 37) % 101 * 4 + 4 for i in range(enqueue.HELD_BATCHES * 2 + 30)]
    store = MemoryStore()
    manifest, sent = stage(tmp_path, hints, store)
    work = {e.batch: e.longest_hint_tokens or 0 for e in manifest.entries(store)}
    assert sorted(o.batch for o in sent) == manifest.batch_ids()  # every batch once
    tail = [work[o.batch] for o in sent[-enqueue.HELD_BATCHES :]]
    assert tail == sorted(tail, reverse=True)
    assert sent[0].batch == "batch-000000"  # GPUs start while staging goes on
    # what waited to the end is the short end of the run
    assert max(tail) <= sorted(work.values())[len(work) // 2]


def test_resume_sends_the_longest_hinted_first(tmp_path: Path) -> None:
    store = MemoryStore()
    manifest, _ = stage(tmp_path, [4, 400, 40], store)
    resent: list[WorkOrder] = []

    def send(orders: list[WorkOrder]) -> int:
        resent.extend(orders)
        return len(orders)

    enqueue.enqueue_missing(store, manifest, send, set())
    assert [o.batch for o in resent] == ["batch-000001", "batch-000002", "batch-000000"]


def test_a_batch_is_as_long_as_its_longest_hinted_answer(tmp_path: Path) -> None:
    # four mid-length answers, then short ones and one very long one: the long one is cut
    # into a batch of its own (hinted work), and goes first
    settings = Settings(batch_size=4, regenerate=True, store=str(tmp_path / "unused"))
    sent: list[WorkOrder] = []
    source = write_source(tmp_path / "d.jsonl", [400, 400, 400, 400, 4, 4, 4, 2000])

    def send(orders: list[WorkOrder]) -> int:
        sent.extend(orders)
        return len(orders)

    options = ReaderOptions(regenerate=True)
    store = MemoryStore()
    manifest, _ = enqueue.stage(settings, store, "r", str(source), options, send, set())
    assert [e.prompts for e in manifest.entries(store)] == [4, 3, 1]
    assert [e.longest_hint_tokens for e in manifest.entries(store)] == [100, 1, 500]
    assert [o.batch for o in sent] == ["batch-000000", "batch-000002", "batch-000001"]
