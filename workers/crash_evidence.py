"""A batch's prompts' engine deaths, kept in Redis where whichever worker runs the batch next
reads them: the one writer and reader of `keys.crash_evidence_key`.

A prompt that kills its engine on arrival is blamed after two of the engine's own deaths with
it arriving, the last alone (`workers/feeding/blame`). Those deaths may fall on two workers:
the first one's engine dies, the worker is lost or its batch's try fails, and the batch runs
elsewhere. Kept here, the count moves with the batch, and the next worker sends the prompt as
a suspect from its first send. Counts only, no times: they are never compared across hosts.

    evidence = CrashEvidence(redis_client)
    evidence.add("run", "batch-000003", PromptRecord("p7", messages))  # the engine died
    evidence.load("run", "batch-000003")  # {"0:p7": 1}: read by the next worker at its start
"""

from __future__ import annotations

import logging

import redis

from genfleet.common import keys
from genfleet.common.records import PromptRecord
from genfleet.common.redis_conn import RedisCommands, text

log = logging.getLogger("genfleet.crash_evidence")


def prompt_key(record: PromptRecord) -> str:
    """A prompt's field in the hash: its sample and id (ids may hold any character but the
    sample, first, is digits up to the first colon)."""
    return f"{record.sample}:{record.id}"


class CrashEvidence:
    """The feeder's `feeding.feeder.Evidence` on Redis. A failing Redis costs the evidence,
    never the batch: a lost count only means more engine restarts before the blame."""

    def __init__(self, client: RedisCommands) -> None:
        self.client = client

    def load(self, run: str, batch: str) -> dict[str, int]:
        """Each prompt's count so far (`prompt_key`), read as a batch starts on a worker."""
        try:
            raw = self.client.hgetall(keys.crash_evidence_key(run, batch))
        except redis.RedisError as exc:
            log.warning("%s/%s: engine deaths of its prompts not read: %s", run, batch, exc)
            return {}
        return {text(field): int(value) for field, value in raw.items()}

    def add(self, run: str, batch: str, record: PromptRecord) -> None:
        """One more of the engine's own deaths with this prompt arriving."""
        key = keys.crash_evidence_key(run, batch)
        try:
            pipe = self.client.pipeline()
            pipe.hincrby(key, prompt_key(record), 1)
            pipe.pexpire(key, keys.CRASH_EVIDENCE_TTL_S * 1000)
            pipe.execute()
        except redis.RedisError as exc:
            log.warning("%s/%s %s: engine death not kept: %s", run, batch, record.id, exc)

    def clear(self, run: str, batch: str) -> None:
        """The batch's output is written: its prompts' counts serve nobody any more."""
        try:
            self.client.delete(keys.crash_evidence_key(run, batch))
        except redis.RedisError as exc:
            log.warning("%s/%s: engine deaths of its prompts not cleared: %s", run, batch, exc)
