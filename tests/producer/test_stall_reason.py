"""Why a run that has not moved is stuck: a table over the facts Redis holds."""

from __future__ import annotations

import orjson
import pytest
import redis

from genfleet.common import keys
from genfleet.producer.status import stall_facts, stall_reason

NOW = 10_000.0
STALLED = {"cause": "engine_stalled", "worker": "w1@h", "suggestion": "killed", "ts": NOW - 5}


@pytest.mark.parametrize(
    ("failed", "seen", "findings", "depth", "expected"),
    [
        (0, {}, [], 3, "no worker answered in that time (3 orders queued)"),
        (0, {"w1@h": NOW - 900}, [], 3, "no worker answered"),  # seen, but long ago
        (0, {"w1@h": NOW - 10}, [STALLED], 3, "engine stalled on w1@h (killed)"),
        (0, {"w1@h": NOW - 10}, [{**STALLED, "ts": NOW - 900}], 3, "but nothing finishes"),
        (2, {"w1@h": NOW - 10}, [], 0, "the 2 failed batches are all that is left"),
        (0, {"w1@h": NOW - 10}, [], 4, "1 workers answer and 4 orders are queued"),
    ],
)
def test_stall_reason(
    failed: int,
    seen: dict[str, float],
    findings: list[dict[str, object]],
    depth: int,
    expected: str,
) -> None:
    reason = stall_reason(
        {"batches_failed": failed},
        still_s=300,
        workers_seen=seen,
        findings=findings,  # type: ignore[arg-type]
        queue_depth=depth,
        now=NOW,
    )
    assert reason.startswith("nothing has moved for 300 s: ")
    assert expected in reason


def test_stall_facts_reads_workers_findings_and_queue(redis_client: redis.Redis) -> None:
    redis_client.hset(keys.workers_key(), "w1@h", NOW)
    redis_client.xadd(keys.findings_key(), {"finding": orjson.dumps({**STALLED, "run": None})})
    redis_client.rpush("gpu", b"a", b"b")
    facts = stall_facts(redis_client, "r", "gpu")
    assert facts["workers_seen"] == {"w1@h": NOW}
    assert facts["queue_depth"] == 2
    assert [f["cause"] for f in facts["findings"]] == ["engine_stalled"]
