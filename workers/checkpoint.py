"""A batch's checkpoint: the parts of finished answers written while it runs, read back on
its next try so that only the prompts without a result are sent again.

Parts are write-once objects numbered from 0 (`keys.part_key`); two copies of one batch (a
redelivery racing the reaper) never overwrite each other's, they take the next number. A
part is written only while the order is still its run's (`provenance.ensure_current`): a
run deleted and staged anew under its name must not receive this staging's answers. On the
next try a part's row stands as a prompt's result only when it names that staged prompt's
digest (`kept_parts`).

A part also keeps answers still in flight that were drawn by token ids (rows with a `drawn`
field, `workers/feeding/drawn`): the next try goes on from the longest one kept of each
prompt, under the same digest rule (`kept_drawn`), instead of drawing it again from its start,
or from a copy and what the batch's journal in Redis kept after it (workers/drawn_journal).
"""

from __future__ import annotations

import logging
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from genfleet.common import keys
from genfleet.common.errors import BatchSuperseded, StoreError
from genfleet.common.records import CompletionRecord, WorkOrder, decode_jsonl_gz, encode_jsonl_gz
from genfleet.common.store import Store
from genfleet.workers.provenance import StagedInput, ensure_current

log = logging.getLogger("genfleet.batch")

# How many of a batch's parts are read from the store at once when it starts (`load_parts`).
PART_READS = 8


def is_result(row: dict[str, Any]) -> bool:
    """A checkpointed row that stands as the prompt's result: a completion or an error record.
    An aborted answer stored as a completion (by a worker before aborts were failed tries) is
    not one: its prompt is sent again."""
    if "drawn" in row:
        return False
    return bool(row.get("error")) or row.get("finish_reason") != "abort"


def load_parts(
    store: Store, run: str, batch: str
) -> tuple[dict[tuple[str, int], Any], int, dict[tuple[str, int], dict[int, Any]]]:
    """Checkpointed results of an earlier try, by (id, sample), the next part number, and the
    copies of answers it had in flight (drawn by ids), by (id, sample) and part number."""
    done: dict[tuple[str, int], Any] = {}
    drawn: dict[tuple[str, int], dict[int, Any]] = {}
    names = list(store.list(keys.parts_prefix(run, batch)))
    for key, data in zip(names, _read_all(store, names), strict=True):
        if data is None:
            continue
        part = keys.part_number(key)
        for row in decode_jsonl_gz(data):
            name = (row["id"], row.get("sample", 0))
            if is_result(row):
                done[name] = row
            elif "drawn" in row:
                drawn.setdefault(name, {})[part] = row
    return done, len(names), drawn


def _read_all(store: Store, names: list[str]) -> list[bytes | None]:
    """The parts' bytes, in order, `PART_READS` at a time: a batch that ran a while before a
    fault holds a part per checkpoint interval, each a store round trip, and one after another
    they held every handed-back batch's start (a new worker's engine filled a few batches a
    second while orders waited). A failed read fails the load, as one read did."""
    if len(names) <= 1:
        return [store.get(name) for name in names]
    with ThreadPoolExecutor(max_workers=min(PART_READS, len(names))) as pool:
        return list(pool.map(store.get, names))


def drawn_row(name: tuple[str, int], digest: str, drawn: dict[str, Any]) -> dict[str, Any]:
    """A checkpoint row of an answer in flight (`Drawn.to_json`), for the staged prompt of
    `digest` only."""
    return {"id": name[0], "sample": name[1], "prompt_sha256": digest, "drawn": drawn}


def write_rows(store: Store, order: WorkOrder, part: int, rows: list[dict[str, Any]]) -> int:
    """Checkpoint rows (answers in flight) as the next part while the order is still its
    run's; returns the next part number."""
    ensure_current(store, order)
    data = encode_jsonl_gz(rows)
    while not store.put_if_absent(keys.part_key(order.run, order.batch, part), data):
        part += 1
    return part + 1


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


def kept_drawn(
    staged: StagedInput,
    rows: dict[tuple[str, int], dict[int, Any]],
    done: dict[tuple[str, int], Any],
) -> dict[tuple[str, int], dict[int, dict[str, Any]]]:
    """The copies of answers in flight checkpointed for the staged prompt of their (id,
    sample) and not finished since, by part, as `Drawn.to_json` data."""
    digests = staged.digest_of()
    return {
        key: {
            part: row["drawn"]
            for part, row in by_part.items()
            if row.get("prompt_sha256") == digests[key]
        }
        for key, by_part in rows.items()
        if key in digests and key not in done
    }


def kept_parts(staged: StagedInput, rows: dict[tuple[str, int], Any]) -> dict[tuple[str, int], Any]:
    """The checkpoint rows that answer the staged prompt of their (id, sample)."""
    digests = staged.digest_of()
    return {
        key: row
        for key, row in rows.items()
        if key in digests and row.get("prompt_sha256") == digests[key]
    }
