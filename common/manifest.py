"""`RUN/manifest.json`: what a run is. Written by the first enqueue; the store's truth.

Status, resume after a Redis loss and retry all compare the manifest's batch list with the
outputs in the store: "enqueue work orders for inputs that have no output".

The batch list is sharded: `RUN/manifest.json` is an index (identity, totals, each shard's
hash), its entries live in write-once shards of SHARD_BATCHES (`keys.manifest_shard_key`),
written as staging goes. A command that walks the run (resume, retry, export, verify) streams
them one at a time; one that needs one batch reads one. Memory stays at one shard's entries
whatever the run's size.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import orjson
from pydantic import BaseModel, ConfigDict, PrivateAttr, model_validator

from genfleet.common.errors import ManifestDamaged, RunMismatch
from genfleet.common.keys import (
    batch_id,
    batch_index,
    claim_key,
    input_key,
    manifest_key,
    manifest_shard_key,
    params_change_key,
)
from genfleet.common.records import GenerationParams
from genfleet.common.store import Store


@dataclass(frozen=True, slots=True)
class RunIdentity:
    """Everything that decides what a run's outputs are: compared field by field when a run
    that exists is enqueued again."""

    fingerprint: str  # sha256 of the staged prompts, as JSON lines, in input order
    params: dict[str, Any]  # generation parameters, as GenerationParams dumps them
    staging: dict[str, Any]  # how prompts were cut into batches
    model: str | None
    engine: str | None
    source: str = ""

    def differences(self, new: RunIdentity) -> list[str]:
        """One line per difference, `what: run has X, now Y`; empty when `new` is the same."""
        found: list[str] = []
        if self.fingerprint != new.fingerprint:
            found.append(
                f"prompts: the run holds {self.source or 'other data'} "
                f"(fingerprint {self.fingerprint[:12]}), now {new.source or 'this source'} "
                f"(fingerprint {new.fingerprint[:12]})"
            )
        pairs = (("engine", self.engine, new.engine), ("model", self.model, new.model))
        for label, old, now in pairs:
            if old != now:
                found.append(f"{label}: the run has {_show(old)}, now {_show(now)}")
        for group_old, group_new in ((self.params, new.params), (self.staging, new.staging)):
            for name in sorted({*group_old, *group_new}):
                old, now = group_old.get(name), group_new.get(name)
                if old != now:
                    found.append(f"{name}: the run has {_show(old)}, now {_show(now)}")
        return found


def _show(value: Any) -> str:
    return "(not recorded)" if value is None else repr(value)


# 2: the fingerprint covers the prompts alone; the model, engine and batching are recorded.
# 3: the batch list is in shards of `shard_batches` entries (`keys.manifest_shard_key`), this
#    object an index of them: no reader holds a 390K-batch list (60 MB of JSON) whole.
MANIFEST_VERSION = 3
# The first version whose identity can be checked (see `Manifest.identity`).
IDENTITY_VERSION = 2
# Entries per shard: one shard is about 200 KB, a 390K-batch run 390 of them (as many GETs as
# its outputs take LIST pages).
SHARD_BATCHES = 1000


class BatchEntry(BaseModel):
    model_config = ConfigDict(extra="ignore")

    batch: str
    key: str  # the staged input object
    prompts: int
    expected_tokens: int = 0  # prompts x max_tokens: the work it may take
    # --regenerate: the longest answer its old answers hint at (None: no hints). A batch's
    # prompts run side by side, so it lasts about as long as its longest answer: the run's
    # orders go out longest first.
    longest_hint_tokens: int | None = None
    sha256: str = ""  # `batch_digest` of the staged lines; "" in runs of an older genfleet


class ShardRef(BaseModel):
    """One shard as the index records it: the hash its bytes are checked against when read,
    and what a resume needs to plan without reading it."""

    model_config = ConfigDict(extra="ignore")

    sha256: str  # of the shard object's bytes
    batches: int
    prompts: int
    longest_hint_tokens: int | None = None  # the longest of its entries' (None: no hints)


class Manifest(BaseModel):
    """A run's manifest: its identity and totals, and the index of its batch list's shards.

    `entries` streams the batch list shard by shard, `entry` reads the one shard holding a
    batch; batch ids are the input order (`keys.batch_id(0 … batches_total-1)`), known without
    reading any shard. A manifest of an older genfleet (version 1 or 2: one object holding
    every entry) is read whole by `load` and serves the same calls from memory."""

    model_config = ConfigDict(extra="ignore")

    version: int = MANIFEST_VERSION
    run: str
    source: str
    format: str
    fingerprint: str  # sha256 of the staged prompts (JSON lines, input order)
    created_at: float
    params: GenerationParams
    # What the outputs come from. None only in manifests written before version 2, whose
    # identity cannot be checked: such a run is never resumed with other settings silently.
    model: str | None = None
    engine: str | None = None
    staging: dict[str, Any] = {}  # batch_size, batch_max_tokens: how batches were cut
    staging_id: str = ""  # the claim's: every work order of this staging carries it
    prompts_total: int
    rejects: int
    # Files that could not be read to their end (corrupt mid-file), and how many of their
    # rows are known to be lost: the run holds less than its source, whatever `status` counts.
    sources_unread: list[str] = []
    rows_unread: int = 0
    batches_total: int
    shard_batches: int = SHARD_BATCHES
    shards: list[ShardRef] = []
    _whole: list[BatchEntry] | None = PrivateAttr(default=None)  # a version 1-2 batch list
    # The shard `entry` read last: the batches one pass looks up are often neighbours.
    _last: tuple[int, list[BatchEntry]] | None = PrivateAttr(default=None)
    # The changes of parameters applied to `params` (`--change-params`), oldest first.
    _changes: list[dict[str, Any]] = PrivateAttr(default_factory=list)

    @model_validator(mode="after")
    def _shards_cover_the_batches(self) -> Manifest:
        if self.version < 3:
            return self
        count = -(-self.batches_total // self.shard_batches) if self.shard_batches > 0 else -1
        if count != len(self.shards) or sum(s.batches for s in self.shards) != self.batches_total:
            raise ValueError(
                f"the index lists {len(self.shards)} shards of "
                f"{sum(s.batches for s in self.shards)} batches for {self.batches_total} "
                f"batches in shards of {self.shard_batches}"
            )
        return self

    def to_bytes(self) -> bytes:
        return orjson.dumps(self.model_dump(), option=orjson.OPT_INDENT_2)

    @classmethod
    def load(cls, store: Store, run: str) -> Manifest | None:
        """The run's manifest (its index: a few KB whatever the run's size), or None when
        staging never finished. Raises ValueError for an object that is not a manifest."""
        data = store.get(manifest_key(run))
        if data is None:
            return None
        fields = orjson.loads(data)
        if isinstance(fields, dict) and isinstance(fields.get("batches"), list):
            manifest = cls._whole_list(fields)
        else:
            manifest = cls.model_validate(fields)
        manifest._apply_changes(store)
        return manifest

    def _apply_changes(self, store: Store) -> None:
        """`params` as the run's changes left them (`RUN/params-changes/`, numbered from 1,
        read in order until one is missing: one GET for a run never changed, no listing):
        what the batches not yet done are sent with, and what the run's identity holds."""
        while (raw := store.get(params_change_key(self.run, len(self._changes) + 1))) is not None:
            change = orjson.loads(raw)
            self.params = self.params.model_copy(update=change["params"])
            self._changes.append(change)

    @property
    def changes(self) -> list[dict[str, Any]]:
        return list(self._changes)

    def record_change(self, store: Store, params: dict[str, Any], at: float, note: str) -> None:
        """Record that the batches not yet done go on with `params` (a write-once object,
        numbered after the last change; a concurrent change of the same number is refused)."""
        change = {"params": params, "at": at, "note": note}
        key = params_change_key(self.run, len(self._changes) + 1)
        if not store.put_if_absent(key, orjson.dumps(change)):
            raise RunMismatch(
                f"run {self.run!r}: another command changed its parameters meanwhile ({key}); "
                "read `genfleet status` and try again"
            )
        self.params = self.params.model_copy(update=params)
        self._changes.append(change)

    @classmethod
    def _whole_list(cls, fields: dict[str, Any]) -> Manifest:
        """A manifest of an older genfleet: every entry in the one object."""
        entries = [BatchEntry.model_validate(entry) for entry in fields.pop("batches")]
        fields = {"version": 2, **fields, "batches_total": len(entries), "shards": []}
        manifest = cls.model_validate(fields)
        manifest._whole = entries
        return manifest

    @property
    def sharded(self) -> bool:
        return self._whole is None

    @property
    def shard_count(self) -> int:
        return len(self.shards) if self.sharded else 1

    @property
    def hinted(self) -> bool:
        """Whether any batch has a length hint (its orders then go out longest first)."""
        if self._whole is not None:
            return any(entry.longest_hint_tokens is not None for entry in self._whole)
        return any(shard.longest_hint_tokens is not None for shard in self.shards)

    def shard(self, store: Store, number: int) -> list[BatchEntry]:
        """The entries of shard `number`, checked against the hash the index recorded.

        Raises ManifestDamaged for a shard that is missing or not what the index says."""
        if self._whole is not None:
            return self._whole
        key = manifest_shard_key(self.run, self.staging_id, number)
        raw = store.get(key)
        if raw is None:
            raise ManifestDamaged(
                f"run {self.run!r}: {key} is missing from {store.url} (the manifest lists "
                f"{len(self.shards)} shards): its batch list cannot be read"
            )
        ref = self.shards[number]
        found = hashlib.sha256(raw).hexdigest()
        if found != ref.sha256:
            raise ManifestDamaged(
                f"run {self.run!r}: {key} in {store.url} is not the shard its manifest "
                f"recorded (sha256 {found[:12]}, recorded {ref.sha256[:12]}): its batch list "
                f"cannot be trusted"
            )
        first = number * self.shard_batches
        entries = [
            BatchEntry(key=input_key(self.run, row["batch"]), **row)
            for row in orjson.loads(raw)["batches"]
        ]
        if [e.batch for e in entries] != [batch_id(first + i) for i in range(ref.batches)]:
            raise ManifestDamaged(f"run {self.run!r}: {key} holds other batches than its place")
        return entries

    def entries(self, store: Store) -> Iterator[BatchEntry]:
        """Every batch's entry in input order, one shard in memory at a time."""
        for number in range(self.shard_count):
            yield from self.shard(store, number)

    def entry(self, store: Store, batch: str) -> BatchEntry | None:
        """`batch`'s entry, reading the one shard that holds it; None for no batch of the run."""
        if not self.has_batch(batch):
            return None
        index = batch_index(batch)
        if self._whole is not None:
            return next((e for e in self._whole if e.batch == batch), None)
        number = index // self.shard_batches
        if self._last is None or self._last[0] != number:
            self._last = (number, self.shard(store, number))
        return self._last[1][index % self.shard_batches]

    def has_batch(self, batch: str) -> bool:
        """Whether `batch` names one of the run's batches (ids are their input order)."""
        try:
            index = batch_index(batch)
        except ValueError:
            return False
        return index < self.batches_total and batch_id(index) == batch

    def batch_ids(self) -> list[str]:
        if self._whole is not None:
            return [entry.batch for entry in self._whole]
        return [batch_id(index) for index in range(self.batches_total)]

    def identity(self) -> RunIdentity:
        checked = self.version >= IDENTITY_VERSION
        fingerprint = self.fingerprint if checked else f"v{self.version}-unchecked"
        return RunIdentity(
            fingerprint=fingerprint,
            params=self.params.model_dump(),
            staging=dict(self.staging),
            model=self.model,
            engine=self.engine,
            source=self.source,
        )

    def summary(self) -> dict[str, Any]:
        return {
            "run": self.run,
            "source": self.source,
            "model": self.model,
            "engine": self.engine,
            "prompts_total": self.prompts_total,
            "batches_total": self.batches_total,
            "rejects": self.rejects,
        }


class ManifestWriter:
    """A run's batch list written as its batches are staged: a shard each `shard_batches`
    entries (write-once), then the index last (`finish`), so that a manifest means staging
    finished. One shard's entries are held at a time, whatever the run's size.

    A staging resumed after an interruption (same claim, same data: the same entries) finds
    its earlier shards written with the same bytes; a shard that differs is refused."""

    def __init__(
        self, store: Store, run: str, staging_id: str, shard_batches: int | None = None
    ) -> None:
        manifest_shard_key(run, staging_id, 0)  # a staging id that can name shards
        self.store = store
        self.run = run
        self.staging_id = staging_id
        self.shard_batches = shard_batches or SHARD_BATCHES
        self.shards: list[ShardRef] = []
        self.pending: list[BatchEntry] = []
        self.batches = 0

    def add(self, entry: BatchEntry) -> None:
        """The next batch's entry (batches come in input order: batch-000000 first)."""
        if entry.batch != batch_id(self.batches):
            raise ValueError(f"{entry.batch} staged where {batch_id(self.batches)} comes next")
        self.pending.append(entry)
        self.batches += 1
        if len(self.pending) == self.shard_batches:
            self._write_shard()

    def _write_shard(self) -> None:
        number = len(self.shards)
        rows = [entry.model_dump(exclude={"key"}) for entry in self.pending]
        data = orjson.dumps({"run": self.run, "shard": number, "batches": rows})
        key = manifest_shard_key(self.run, self.staging_id, number)
        if not self.store.put_if_absent(key, data) and self.store.get(key) != data:
            raise RunMismatch(
                f"run {self.run!r}: {key}, written by an earlier try of this staging, holds "
                f"other batches than this one stages: no manifest written; `genfleet delete "
                f"{self.run}` and stage it again"
            )
        hints = [e.longest_hint_tokens for e in self.pending if e.longest_hint_tokens is not None]
        self.shards.append(
            ShardRef(
                sha256=hashlib.sha256(data).hexdigest(),
                batches=len(self.pending),
                prompts=sum(entry.prompts for entry in self.pending),
                longest_hint_tokens=max(hints) if hints else None,
            )
        )
        self.pending = []

    def finish(self, **fields: Any) -> Manifest:
        """Write the last shard and the index (`fields`: the manifest's own, less the batch
        list's); returns the manifest."""
        if self.pending:
            self._write_shard()
        manifest = Manifest(
            run=self.run,
            staging_id=self.staging_id,
            batches_total=self.batches,
            shard_batches=self.shard_batches,
            shards=self.shards,
            **fields,
        )
        self.store.put(manifest_key(self.run), manifest.to_bytes())
        return manifest


def write_manifest(
    store: Store,
    run: str,
    staging_id: str,
    entries: Iterable[BatchEntry],
    shard_batches: int | None = None,
    **fields: Any,
) -> Manifest:
    """A run's whole manifest, its batch list given at once (a run written straight into a
    store: the tests' and the benches')."""
    writer = ManifestWriter(store, run, staging_id, shard_batches)
    for entry in entries:
        writer.add(entry)
    return writer.finish(**fields)


def current_staging(store: Store, run: str) -> str | None:
    """The staging id of `run`'s claim (`RUN/claim.json`), read from the store: the one
    staging whose work orders may still write into the run. None when the run has no claim
    (deleted, or never staged); "" for a claim of an older genfleet, which has none.

    A worker reads it when a batch starts and before each write, so an order of a staging
    that was superseded (the run deleted, maybe staged anew under the same name) never
    writes into the run that replaced it. No clock is compared: ids are random.
    """
    raw = store.get(claim_key(run))
    if raw is None:
        return None
    return str(orjson.loads(raw).get("staging_id") or "")
