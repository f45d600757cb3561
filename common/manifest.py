"""`RUN/manifest.json`: what a run is. Written by the first enqueue; the store's truth.

Status, resume after a Redis loss and retry all compare the manifest's batch list with the
outputs in the store: "enqueue work orders for inputs that have no output".
"""

from __future__ import annotations

from typing import Any

import orjson
from pydantic import BaseModel, ConfigDict

from genfleet.common.keys import manifest_key
from genfleet.common.records import GenerationParams
from genfleet.common.store import Store

MANIFEST_VERSION = 1


class BatchEntry(BaseModel):
    model_config = ConfigDict(extra="ignore")

    batch: str
    key: str  # the staged input object
    prompts: int
    expected_tokens: int = 0  # prompts x max_tokens: the work it may take


class Manifest(BaseModel):
    model_config = ConfigDict(extra="ignore")

    version: int = MANIFEST_VERSION
    run: str
    source: str
    format: str
    fingerprint: str  # hash of the staged prompts and params: same data, same run
    created_at: float
    params: GenerationParams
    prompts_total: int
    rejects: int
    batches: list[BatchEntry]

    def to_bytes(self) -> bytes:
        return orjson.dumps(self.model_dump(), option=orjson.OPT_INDENT_2)

    @classmethod
    def load(cls, store: Store, run: str) -> Manifest | None:
        data = store.get(manifest_key(run))
        if data is None:
            return None
        return cls.model_validate(orjson.loads(data))

    def batch_ids(self) -> list[str]:
        return [entry.batch for entry in self.batches]

    def summary(self) -> dict[str, Any]:
        return {
            "run": self.run,
            "source": self.source,
            "prompts_total": self.prompts_total,
            "batches_total": len(self.batches),
            "rejects": self.rejects,
        }
