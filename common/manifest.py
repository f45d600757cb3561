"""`RUN/manifest.json`: what a run is. Written by the first enqueue; the store's truth.

Status, resume after a Redis loss and retry all compare the manifest's batch list with the
outputs in the store: "enqueue work orders for inputs that have no output".
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import orjson
from pydantic import BaseModel, ConfigDict

from genfleet.common.keys import claim_key, manifest_key
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
MANIFEST_VERSION = 2


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


class Manifest(BaseModel):
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
    batches: list[BatchEntry]

    def to_bytes(self) -> bytes:
        return orjson.dumps(self.model_dump(), option=orjson.OPT_INDENT_2)

    @classmethod
    def load(cls, store: Store, run: str) -> Manifest | None:
        data = store.get(manifest_key(run))
        if data is None:
            return None
        return cls.model_validate(orjson.loads(data))

    def identity(self) -> RunIdentity:
        fingerprint = self.fingerprint if self.version >= 2 else f"v{self.version}-unchecked"
        return RunIdentity(
            fingerprint=fingerprint,
            params=self.params.model_dump(),
            staging=dict(self.staging),
            model=self.model,
            engine=self.engine,
            source=self.source,
        )

    def batch_ids(self) -> list[str]:
        return [entry.batch for entry in self.batches]

    def summary(self) -> dict[str, Any]:
        return {
            "run": self.run,
            "source": self.source,
            "model": self.model,
            "engine": self.engine,
            "prompts_total": self.prompts_total,
            "batches_total": len(self.batches),
            "rejects": self.rejects,
        }


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
