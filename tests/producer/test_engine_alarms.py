"""What `status` says of an engine that needs a person: the alarms workers publish, read for
one run's queue, and the line each makes."""

from __future__ import annotations

from typing import Any

import orjson
import pytest
import redis

from genfleet.common import keys
from genfleet.producer.status import engine_alarm_text, engine_alarms, stall_reason

NOW = 10_000.0
LOOP = {
    "error": "RuntimeError: The expanded size of the tensor (33554432) must match",
    "repeats": 4,
    "loop": True,
    "flaky": False,
    "known": "sglang_cuda_graph_verify_buffers",
    "what": "SGLang crashes at its largest captured CUDA graph",
    "workaround": "--disable-cuda-graph avoids it",
}
FLAKY = {"error": "OSError: NCCL timeout", "repeats": 1, "loop": False, "flaky": True}


def alarm(**fields: Any) -> dict[str, Any]:
    base = {
        "worker": "gpu-0@node",
        "queue": "gpu.emulator",
        "exhausted": False,
        "crash": None,
        "restarts_in_window": 5,
        "restart_window_s": 3600.0,
        "cooldown_left_s": None,
        "ts": NOW - 30,
    }
    return {**base, **fields}


@pytest.mark.parametrize(
    ("given", "expected"),
    [
        (alarm(crash=LOOP), ["crash loop, the same error 4 times", "33554432",
                             "--disable-cuda-graph avoids it", "reported 30 s ago"]),
        (alarm(crash={**LOOP, "known": None, "what": None, "workaround": None}),
         ["crash loop", "a restart will not fix it: read the engine log"]),
        (alarm(exhausted=True, cooldown_left_s=540.0, crash=FLAKY),
         ["restart budget spent (5 restarts in 3600 s), not taking work, back in 540 s",
          "flaky", "NCCL timeout"]),
        (alarm(exhausted=True, cooldown_left_s=12.0, crash=LOOP),
         ["restart budget spent", "back in 12 s", "crash loop", "--disable-cuda-graph"]),
    ],
)  # fmt: skip
def test_engine_alarm_line(given: dict[str, Any], expected: list[str]) -> None:
    line = engine_alarm_text(given, NOW)
    assert line.startswith("gpu-0@node: ")
    for part in expected:
        assert part in line, (part, line)


@pytest.mark.integration
def test_alarms_of_the_runs_queue_only(redis_client: redis.Redis) -> None:
    redis_client.hset(keys.engine_alarms_key(), "gpu-0@a", orjson.dumps(alarm(crash=LOOP)))
    other = alarm(queue="gpu.other-model", crash=LOOP)
    redis_client.hset(keys.engine_alarms_key(), "gpu-0@b", orjson.dumps(other))
    redis_client.hset(keys.engine_alarms_key(), "gpu-0@c", b"not json")
    found = engine_alarms(redis_client, "gpu.emulator")
    assert [a["worker"] for a in found] == ["gpu-0@a"]
    assert engine_alarms(redis_client, "gpu.nothing") == []


def test_a_stalled_runs_reason_names_a_crash_loop() -> None:
    finding = {"cause": "crash_loop", "worker": "w1@h", "suggestion": "use X", "ts": NOW - 5}
    reason = stall_reason(
        {"batches_failed": 0},
        still_s=300,
        workers_seen={"w1@h": NOW - 10},
        findings=[finding],
        queue_depth=3,
        now=NOW,
    )
    assert "crash loop on w1@h (use X)" in reason
