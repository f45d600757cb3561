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
    ("failed", "seen", "findings", "depth", "loading", "expected"),
    [
        (0, {}, [], 3, [], "no worker answered in that time (3 orders queued)"),
        (0, {"w1@h": NOW - 900}, [], 3, [], "no worker answered"),  # seen, but long ago
        (0, {"w1@h": NOW - 10}, [STALLED], 3, [], "engine stalled on w1@h (killed)"),
        (0, {"w1@h": NOW - 10}, [{**STALLED, "ts": NOW - 900}], 3, [], "but nothing finishes"),
        (2, {"w1@h": NOW - 10}, [], 0, [], "the 2 failed batches are all that is left"),
        (0, {"w1@h": NOW - 10}, [], 4, [], "1 workers answer and 4 orders are queued"),
        # an engine loading for longer than the stall time: not "start a worker"
        (0, {}, [], 3, ["w2@h"], "1 worker still loading the engine for this run (w2@h), 3"),
        (0, {}, [], 3, [f"w{i}@h" for i in range(7)], "7 workers still loading"),
    ],
)
def test_stall_reason(
    failed: int,
    seen: dict[str, float],
    findings: list[dict[str, object]],
    depth: int,
    loading: list[str],
    expected: str,
) -> None:
    reason = stall_reason(
        {"batches_failed": failed},
        still_s=300,
        workers_seen=seen,
        findings=findings,  # type: ignore[arg-type]
        queue_depth=depth,
        now=NOW,
        loading=loading,
    )
    assert reason.startswith("nothing has moved for 300 s: ")
    assert expected in reason


def test_stall_facts_reads_workers_findings_and_queue(redis_client: redis.Redis) -> None:
    redis_client.hset(keys.workers_key(), "w1@h", NOW)
    redis_client.xadd(keys.findings_key(), {"finding": orjson.dumps({**STALLED, "run": None})})
    redis_client.rpush("gpu", b"a", b"b")
    loading = {"worker": "w2@h", "ok": False, "queue": "gpu"}
    other = {"worker": "w3@h", "ok": False, "queue": "gpu.other"}
    redis_client.hset(keys.summaries_key(), "w2@h", orjson.dumps(loading))
    redis_client.hset(keys.summaries_key(), "w3@h", orjson.dumps(other))
    redis_client.hset(keys.summaries_key(), "w4@h", orjson.dumps({**loading, "worker": "w4@h"}))
    now = float(redis_client.time()[0])
    # w4 pushed long ago: it died loading
    redis_client.zadd(keys.pushed_key(), {"w2@h": now, "w3@h": now, "w4@h": now - 600})
    facts = stall_facts(redis_client, "r", "gpu", summary_ttl_s=180)
    assert facts["workers_seen"] == {"w1@h": NOW}
    assert facts["queue_depth"] == 2
    assert [f["cause"] for f in facts["findings"]] == ["engine_stalled"]
    assert facts["loading"] == ["w2@h"]
    assert stall_facts(redis_client, "r", "gpu")["loading"] == []  # no TTL given: not read
