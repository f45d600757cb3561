"""A batch's prompts' engine deaths in Redis (`workers/crash_evidence`): what one worker adds,
the next reads; a written output clears them; a failing Redis costs the evidence, not the
batch."""

from __future__ import annotations

import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from genfleet.common import keys
from genfleet.common.records import PromptRecord
from genfleet.workers.crash_evidence import CrashEvidence

POISON = PromptRecord(id="p:7", messages=[{"role": "user", "content": "x"}], sample=2)


def test_deaths_added_on_one_worker_are_read_by_the_next(redis_client: redis.Redis) -> None:
    first, second = CrashEvidence(redis_client), CrashEvidence(redis_client)
    assert second.load("run", "batch-000003") == {}
    first.add("run", "batch-000003", POISON)
    first.add("run", "batch-000003", POISON)
    assert second.load("run", "batch-000003") == {"2:p:7": 2}
    assert second.load("run", "batch-000004") == {}
    ttl_s = redis_client.ttl(keys.crash_evidence_key("run", "batch-000003"))
    assert 0 < ttl_s <= keys.CRASH_EVIDENCE_TTL_S
    second.clear("run", "batch-000003")
    assert first.load("run", "batch-000003") == {}


def test_a_redis_that_fails_costs_the_evidence_not_the_batch() -> None:
    down = redis.Redis(
        host="127.0.0.1", port=1, socket_connect_timeout=0.2, retry=Retry(NoBackoff(), 0)
    )
    evidence = CrashEvidence(down)
    evidence.add("run", "batch-000000", POISON)
    assert evidence.load("run", "batch-000000") == {}
    evidence.clear("run", "batch-000000")
