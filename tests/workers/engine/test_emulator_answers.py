"""The emulator's bad answers, each on its own: what a test of the client can count on."""

from __future__ import annotations

from pathlib import Path

import httpx
import orjson

from tests.support import StartEmulator

CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 64}


def test_a_429_carries_retry_after(start_emulator: StartEmulator) -> None:
    emulator = start_emulator(
        env={"GENFLEET_EMULATOR_429_RATE": "1", "GENFLEET_EMULATOR_RETRY_AFTER_S": "0.25"}
    )
    response = httpx.post(f"{emulator.base_url}/v1/chat/completions", json=CHAT, timeout=10)
    assert response.status_code == 429
    assert response.headers["Retry-After"] == "0.25"
    assert response.json()["error"]["type"] == "rate_limit_error"


def test_an_abort_is_a_200_with_partial_text(start_emulator: StartEmulator) -> None:
    emulator = start_emulator(env={"GENFLEET_EMULATOR_ABORT_RATE": "1"})
    response = httpx.post(f"{emulator.base_url}/v1/chat/completions", json=CHAT, timeout=10)
    assert response.status_code == 200
    assert response.json()["choices"][0]["finish_reason"] == "abort"


def test_openai_usage_shape(start_emulator: StartEmulator) -> None:
    emulator = start_emulator(
        "--reasoning-parser", "qwen3", env={"GENFLEET_EMULATOR_USAGE_SHAPE": "openai"}
    )
    usage = httpx.post(f"{emulator.base_url}/v1/chat/completions", json=CHAT, timeout=10).json()[
        "usage"
    ]
    assert "reasoning_tokens" not in usage
    assert usage["completion_tokens_details"]["reasoning_tokens"] > 0


def test_a_lower_enforced_cap_is_reported_per_dp_rank(
    start_emulator: StartEmulator, tmp_path: Path
) -> None:
    log = tmp_path / "requests.jsonl"
    emulator = start_emulator(
        "--max-running-requests",
        "64",
        "--dp-size",
        "2",
        env={
            "GENFLEET_EMULATOR_EFFECTIVE_MAX_RUNNING_REQUESTS": "20",
            "GENFLEET_EMULATOR_REQUEST_LOG": str(log),
        },
    )
    info = httpx.get(f"{emulator.base_url}/server_info", timeout=10).json()
    assert info["max_running_requests"] == 64
    assert [s["effective_max_running_requests_per_dp"] for s in info["internal_states"]] == [10, 10]
    body = {**CHAT, "top_k": 20, "seed": 7}
    httpx.post(f"{emulator.base_url}/v1/chat/completions", json=body, timeout=10)
    (entry,) = [orjson.loads(line) for line in log.read_bytes().splitlines()]
    assert entry["body"] == body and entry["outcome"] == "ok" and len(entry["id"]) == 32
