"""Reading a batch's checkpoint back: every part, in order, several at a time."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest

from genfleet.common import keys
from genfleet.common.errors import StoreUnavailable
from genfleet.common.records import encode_jsonl_gz
from genfleet.common.store import FileStore
from genfleet.workers import checkpoint


class SlowStore(FileStore):
    """A store whose reads take a round trip's time; it counts how many ran at once."""

    def __init__(self, root: Path, fail: str | None = None) -> None:
        super().__init__(root)
        self.fail = fail
        self.running = self.most = 0
        self._lock = threading.Lock()

    def get(self, key: str) -> bytes | None:
        with self._lock:
            self.running += 1
            self.most = max(self.most, self.running)
        try:
            time.sleep(0.05)
            if key == self.fail:
                raise StoreUnavailable(f"cannot read {key}")
            return super().get(key)
        finally:
            with self._lock:
                self.running -= 1


def write_parts(store: FileStore, parts: int) -> None:
    """Part n finishes prompt pn and holds prompt "live"'s answer as drawn after n tokens."""
    for n in range(parts):
        rows = [
            {"id": f"p{n}", "sample": 0, "finish_reason": "stop", "content": f"a{n}"},
            {"id": "live", "sample": 0, "drawn": {"ids": list(range(n + 1))}},
        ]
        store.put(keys.part_key("r", "batch-000000", n), encode_jsonl_gz(rows))


def test_a_batchs_parts_are_read_several_at_a_time_and_kept_in_order(tmp_path: Path) -> None:
    """A batch that ran a while before a fault holds a part per checkpoint: read back one
    after another they held each handed-back batch's start a round trip per part."""
    store = SlowStore(tmp_path)
    write_parts(store, 12)
    done, next_part, drawn = checkpoint.load_parts(store, "r", "batch-000000")
    assert 2 <= store.most <= checkpoint.PART_READS
    assert next_part == 12
    assert {name: row["content"] for name, row in done.items()} == {
        (f"p{n}", 0): f"a{n}" for n in range(12)
    }
    # every part's copy of the live answer, under its own part number
    assert {part: len(row["drawn"]["ids"]) for part, row in drawn[("live", 0)].items()} == {
        n: n + 1 for n in range(12)
    }


def test_one_part_that_cannot_be_read_fails_the_load(tmp_path: Path) -> None:
    store = SlowStore(tmp_path, fail=keys.part_key("r", "batch-000000", 7))
    write_parts(store, 12)
    with pytest.raises(StoreUnavailable, match="part-00007"):
        checkpoint.load_parts(store, "r", "batch-000000")


def test_a_batch_without_parts_reads_nothing(tmp_path: Path) -> None:
    store = SlowStore(tmp_path)
    assert checkpoint.load_parts(store, "r", "batch-000000") == ({}, 0, {})
    assert store.most == 0
