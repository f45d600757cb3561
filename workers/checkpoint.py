"""A batch's checkpoint: the parts of finished answers written while it runs, read back on
its next try so that only the prompts without a result are sent again.

Parts are write-once objects numbered from 0 (`keys.part_key`); two copies of one batch (a
redelivery racing the reaper) never overwrite each other's, they take the next number. A
part is written only while the order is still its run's (`provenance.ensure_current`): a
run deleted and staged anew under its name must not receive this staging's answers. On the
next try a part's row stands as a prompt's result only when it names that staged prompt's
digest (`kept_parts`).
"""

from __future__ import annotations

import logging
from typing import Any

from genfleet.common import keys
from genfleet.common.errors import BatchSuperseded, StoreError
from genfleet.common.records import CompletionRecord, WorkOrder, decode_jsonl_gz, encode_jsonl_gz
from genfleet.common.store import Store
from genfleet.workers.provenance import StagedInput, ensure_current

log = logging.getLogger("genfleet.batch")


def is_result(row: dict[str, Any]) -> bool:
    """A checkpointed row that stands as the prompt's result: a completion or an error record.
    An aborted answer stored as a completion (by a worker before aborts were failed tries) is
    not one: its prompt is sent again."""
    return bool(row.get("error")) or row.get("finish_reason") != "abort"


def load_parts(store: Store, run: str, batch: str) -> tuple[dict[tuple[str, int], Any], int]:
    """Checkpointed results of an earlier try, by (id, sample), and the next part number."""
    done: dict[tuple[str, int], Any] = {}
    count = 0
    for key in store.list(keys.parts_prefix(run, batch)):
        data = store.get(key)
        count += 1
        if data is None:
            continue
        for row in decode_jsonl_gz(data):
            if is_result(row):
                done[(row["id"], row.get("sample", 0))] = row
    return done, count


def write_part(store: Store, run: str, batch: str, part: int, rows: list[CompletionRecord]) -> int:
    """Write a checkpoint part at the first free part number from `part`; returns the next."""
    data = encode_jsonl_gz(row.to_json() for row in rows)
    while not store.put_if_absent(keys.part_key(run, batch, part), data):
        part += 1  # a parallel copy of this batch wrote this number: take the next
    return part + 1


def save(store: Store, order: WorkOrder, part: int, rows: list[CompletionRecord]) -> int:
    """Checkpoint `rows` as the next part while the order is still its run's; returns the
    next part number. Raises BatchSuperseded when the run was staged anew, StoreError."""
    ensure_current(store, order)
    return write_part(store, order.run, order.batch, part, rows)


def save_finished(store: Store, order: WorkOrder, part: int, rows: list[CompletionRecord]) -> None:
    """On a failed try, checkpoint what finished so the retry skips it; best effort.

    When the store itself is what failed, this fails too: the prompts are then simply done
    again, and the original error (not this one) decides between retry and failed set.
    """
    if not rows:
        return
    try:
        save(store, order, part, rows)
    except (StoreError, BatchSuperseded) as exc:
        log.warning("could not checkpoint %s/%s: %s", order.run, order.batch, exc)


def kept_parts(staged: StagedInput, rows: dict[tuple[str, int], Any]) -> dict[tuple[str, int], Any]:
    """The checkpoint rows that answer the staged prompt of their (id, sample)."""
    digests = staged.digest_of()
    return {
        key: row
        for key, row in rows.items()
        if key in digests and row.get("prompt_sha256") == digests[key]
    }
