"""A run's progress in Redis: which batches are done and how many prompts that is, in O(1).

The store is the truth (a batch is done when its output object exists), but listing it costs
one LIST page per thousand batches: `status` every second of a 390K-batch run cannot. So
Redis keeps a copy, written where the truth changes and repaired from the truth:

- `mark_written` (in the pipeline of the worker that wrote the output object: exactly one per
  object, since outputs are write-once) adds the batch to the run's done hash (batch →
  prompts) and its prompts to the `prompts_done` counter; `mark_seen` (a worker that found
  the output already there) adds it to the hash only.
- `snapshot` reads what `status` needs (the manifest's summary, batches and prompts done) in
  one round trip; None when Redis holds no reconciled copy (never reconciled, or Redis lost
  everything), and the caller reconciles from the store first.
- `reconcile`, given the store's listing, repairs the hash (missing batches added, batches
  without output removed, prompt counts from the manifest) and recomputes `prompts_done`
  from it atomically: run by `status --verify`, by a status that finds no copy, on resume, and
  by the control worker's beat (`workers/control/progress_repair.py`), never by a plain `status`.

Between reconciles the copy can only lag the truth (a counter lost to a Redis failure after
the output was written): it never counts a batch whose output does not exist.
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import orjson
import redis

from genfleet.common import counters, keys
from genfleet.common.manifest import Manifest
from genfleet.common.redis_conn import RedisCommands, RedisPipeline, text
from genfleet.common.store import Store

PROMPTS_DONE = counters.PROMPTS_DONE  # the counters field this copy keeps

_CHUNK = 1000


def mark_written(pipe: RedisPipeline, run: str, batch: str, prompts: int) -> None:
    """Queue, in the pipeline of the worker whose `put_if_absent` wrote the output: the batch
    is done with `prompts` prompts."""
    pipe.hset(keys.done_key(run), batch, prompts)
    counters.add_prompts_done(pipe, run, prompts)


def mark_found(client: RedisCommands, run: str, batch: str, prompts: int) -> bool:
    """The batch's output exists and the worker that wrote it was lost, maybe before its
    transaction: count it now unless that transaction ran (True when this call counted it).
    A copy that only saw the output (`mark_seen`) counted no prompts: the reconcile's
    recount repairs that, as before."""
    return counters.add_prompts_done_once(client, run, keys.done_key(run), batch, prompts)


def mark_seen(pipe: RedisPipeline, run: str, batch: str, prompts: int) -> None:
    """Queue: the batch's output exists (written by another copy, which counted it)."""
    pipe.hset(keys.done_key(run), batch, prompts)


@dataclass(frozen=True)
class Snapshot:
    """What Redis knows of a run's progress, read in one round trip."""

    run: str
    summary: dict[str, Any]  # Manifest.summary() plus created_at
    batches_done: int
    prompts_done: int
    reconciled_at: float
    counters: dict[str, str] = field(default_factory=dict)


def snapshot(client: redis.Redis, run: str) -> Snapshot | None:
    """The run's progress from Redis, or None when no reconciled copy is there."""
    pipe = client.pipeline(transaction=False)
    pipe.hgetall(keys.summary_key(run))
    pipe.hlen(keys.done_key(run))
    counters.queue_read(pipe, run)
    raw_summary, done, raw_counters = pipe.execute()
    fields = {text(k): v for k, v in raw_summary.items()}
    if "manifest" not in fields or "reconciled_at" not in fields:
        return None
    found = counters.decode(raw_counters)
    summary = orjson.loads(fields["manifest"])
    return Snapshot(
        run=run,
        summary=summary,
        batches_done=min(int(done), int(summary["batches_total"])),
        prompts_done=min(int(found.get(PROMPTS_DONE, 0)), int(summary["prompts_total"])),
        reconciled_at=float(fields["reconciled_at"]),
        counters=found,
    )


def done_among(client: redis.Redis, run: str, batches: Iterable[str]) -> set[str]:
    """Those of `batches` the done hash holds (a failed batch retried and finished)."""
    wanted = list(batches)
    if not wanted:
        return set()
    found = client.hmget(keys.done_key(run), wanted)
    return {batch for batch, value in zip(wanted, found, strict=True) if value is not None}


@dataclass
class Repair:
    """What a reconcile changed: an honest copy changes nothing."""

    run: str
    added: list[str] = field(default_factory=list)  # outputs the hash lacked
    removed: list[str] = field(default_factory=list)  # hash entries without an output
    recounted: list[str] = field(default_factory=list)  # entries with the wrong prompt count
    unfailed: list[str] = field(default_factory=list)  # in the failed set, yet written (the
    # ledger's repair, `Ledger.unfail_done`, recorded here by the caller)
    prompts_done_was: int = 0
    prompts_done: int = 0

    @property
    def changed(self) -> bool:
        return bool(
            self.added
            or self.removed
            or self.recounted
            or self.prompts_done_was != self.prompts_done
        )

    def to_json(self) -> dict[str, Any]:
        return {
            "run": self.run,
            "added": len(self.added),
            "removed": len(self.removed),
            "recounted": len(self.recounted),
            "unfailed": len(self.unfailed),
            "prompts_done_was": self.prompts_done_was,
            "prompts_done": self.prompts_done,
        }


def reconcile(
    client: redis.Redis,
    store: Store,
    manifest: Manifest,
    listed: set[str],
    now: float | None = None,
    still_absent: Any = None,
) -> Repair:
    """Make Redis's copy agree with the store's listing `listed` (batches with an output).

    The manifest is read shard by shard, the done hash a shard's batches at a time (one HMGET
    each): what is held is one shard, whatever the run's size. A batch in the hash but not in
    the listing may have finished after the listing was taken: it is removed only when
    `still_absent(batch)` (a fresh existence check) says so; without that check it is kept.
    An entry of no batch of the run is removed. Workers may write while this runs: their
    entries are only added, and `prompts_done` is recomputed from the hash atomically at the
    end.
    """
    run = manifest.run
    repair = Repair(run=run)
    done = keys.done_key(run)
    held_of_run = 0  # hash entries that name a batch of the run
    pipe = client.pipeline(transaction=False)
    for number in range(manifest.shard_count):
        entries = manifest.shard(store, number)
        found = client.hmget(done, [entry.batch for entry in entries])
        for entry, value in zip(entries, found, strict=True):
            held_of_run += value is not None
            if entry.batch in listed:
                if value is None:
                    repair.added.append(entry.batch)
                elif int(value) != entry.prompts:
                    repair.recounted.append(entry.batch)
                else:
                    continue
                pipe.hset(done, entry.batch, entry.prompts)
            elif value is not None and still_absent is not None and still_absent(entry.batch):
                repair.removed.append(entry.batch)
                pipe.hdel(done, entry.batch)
            if len(pipe) >= _CHUNK:
                pipe.execute()
    pipe.execute()
    if int(client.hlen(done)) > held_of_run:  # entries of no batch of the run (rare): a scan
        for raw, _ in client.hscan_iter(done, count=_CHUNK):
            if not manifest.has_batch(batch := text(raw)):
                repair.removed.append(batch)
                client.hdel(done, batch)
    repair.prompts_done_was = counters.prompts_done(client, run)
    repair.prompts_done = counters.recount_prompts_done(client, run, done)
    summary = {
        **manifest.summary(),
        "created_at": manifest.created_at,
        "sources_unread": manifest.sources_unread,
        "rows_unread": manifest.rows_unread,
    }
    client.hset(
        keys.summary_key(run),
        mapping={
            "manifest": orjson.dumps(summary),
            "reconciled_at": time.time() if now is None else now,
        },
    )
    return repair


def listed_done(store: Store, run: str) -> set[str]:
    """Batches whose output object exists: the store's word on what is finished."""
    return {keys.batch_from_output_key(k) for k in store.list(keys.outputs_prefix(run))}


@dataclass(frozen=True)
class Verified:
    """A copy repaired from the store: the copy, what changed, and the listing it came from
    (for the ledger's own repair: a failed batch whose output exists is done)."""

    snapshot: Snapshot
    repair: Repair
    listed: set[str]


def verify(
    store: Store, client: redis.Redis, run: str, now: float | None = None
) -> Verified | None:
    """List the run's outputs (the truth) and repair Redis's copy from them; None when the
    run has no manifest. O(batches)."""
    manifest = Manifest.load(store, run)
    if manifest is None:
        return None
    listed = listed_done(store, run)
    repair = reconcile(
        client,
        store,
        manifest,
        listed,
        now,
        still_absent=lambda batch: not store.exists(keys.output_key(run, batch)),
    )
    snap = snapshot(client, run)
    assert snap is not None  # written just above
    return Verified(snap, repair, listed)
