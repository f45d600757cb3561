"""The emulator's bad answers, each on its own: what a test of the client can count on."""

from __future__ import annotations

from pathlib import Path

import httpx
import orjson

from genfleet.workers.feeding.repetition import RepetitionDetector, RepetitionRule
from tests.support.emulator import StartEmulator

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
    entry, end = [orjson.loads(line) for line in log.read_bytes().splitlines()]
    assert entry["body"] == body and entry["outcome"] == "ok" and len(entry["id"]) == 32
    assert (end["outcome"], end["id"]) == ("end", entry["id"]) and end["generated"] > 0


def _texts(emulator_url: str, count: int, **extra: object) -> list[dict[str, object]]:
    answers = []
    with httpx.Client(base_url=emulator_url, timeout=30) as client:
        for i in range(count):
            body = {**CHAT, "messages": [{"role": "user", "content": f"q{i}"}], **extra}
            answers.append(client.post("/v1/chat/completions", json=body).json())
    return answers


def test_looping_answers_repeat_one_block_to_max_tokens(start_emulator: StartEmulator) -> None:
    emulator = start_emulator(
        "--reasoning-parser", "qwen3", env={"GENFLEET_EMULATOR_LOOP_RATE": "1"}
    )
    rule = RepetitionRule()
    for answer in _texts(emulator.base_url, 6, max_tokens=3000):
        choice = answer["choices"][0]  # type: ignore[index]
        assert choice["finish_reason"] == "length"
        assert answer["usage"]["completion_tokens"] == 3000  # type: ignore[index]
        text = choice["message"]["reasoning_content"]
        detector = RepetitionDetector(rule)
        loops = [detector.feed(text[i : i + 128]) for i in range(0, len(text), 128)]
        assert any(loops), text[-300:]


def test_legitimately_repetitive_answers_are_never_loops(start_emulator: StartEmulator) -> None:
    emulator = start_emulator(
        "--reasoning-parser",
        "qwen3",
        env={
            "GENFLEET_EMULATOR_LEGIT_REPEAT_RATE": "1",
            "GENFLEET_EMULATOR_MEAN_COMPLETION_TOKENS": "4000",
        },
    )
    starts = set()
    for answer in _texts(emulator.base_url, 12, max_tokens=6000, ignore_eos=True):
        content = answer["choices"][0]["message"]["content"]  # type: ignore[index]
        starts.add(content[:4])
        assert content.count("\n") + content.count("item ") >= 20  # rows, lines, items
        detector = RepetitionDetector(RepetitionRule())
        assert not any(detector.feed(content[i : i + 128]) for i in range(0, len(content), 128))
    assert len(starts) >= 3  # tables, lists, code, refrains, enumerations: several kinds
