"""The emulator pinned to sglang-contract.md: lifecycle, shapes, errors, streams, cap, power."""

from __future__ import annotations

import contextlib
import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from harness.waits import wait_for
from tests.support.emulator import Emulator, StartEmulator

pytestmark = pytest.mark.integration

SPEC_FLAGS = (
    "--reasoning-parser",
    "qwen3",
    "--speculative-algo",
    "NEXTN",
    "--tp",
    "2",
    "--context-length",
    "4096",
    "--enable-metrics",
    "--mamba-scheduler-strategy",
    "extra_buffer",
    "--tool-call-parser",
    "qwen3_coder",
    "--trust-remote-code",
    "--attention-backend",
    "fa3",
    "--some-future-flag",
    "value",
)
ERROR_A_KEYS = {"object", "message", "type", "param", "code"}


@pytest.fixture(scope="module")
def spec(start_emulator: StartEmulator) -> Emulator:
    """Spec on (NEXTN), a reasoning parser, tp 2, metrics, and flags it must ignore."""
    return start_emulator(*SPEC_FLAGS)


@pytest.fixture(scope="module")
def client(spec: Emulator) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=spec.base_url, timeout=10) as c:
        yield c


def chat(client: httpx.Client, content: str = "hello", **extra: Any) -> httpx.Response:
    body = {"model": "anything", "messages": [{"role": "user", "content": content}], **extra}
    return client.post("/v1/chat/completions", json=body)


def sse_events(response: httpx.Response) -> list[Any]:
    events: list[Any] = []
    for line in response.iter_lines():
        if line.startswith("data: "):
            data = line[len("data: ") :]
            events.append(data if data == "[DONE]" else json.loads(data))
    return events


def test_lifecycle_refused_then_503_then_200(start_emulator: StartEmulator) -> None:
    slow = {"GENFLEET_EMULATOR_LOAD_S": "0.8", "GENFLEET_EMULATOR_WARMUP_S": "0.8"}
    emu = start_emulator(env=slow, ready=False)
    assert emu.health_status() is None
    wait_for(lambda: emu.health_status() == 503, 10, "/health 503 after bind", 0.01)
    starting = httpx.get(f"{emu.base_url}/health")
    assert starting.content == b""
    assert httpx.get(f"{emu.base_url}/v1/models").status_code == 200
    assert httpx.get(f"{emu.base_url}/model_info").status_code == 200
    emu.wait_ready()
    ready = httpx.get(f"{emu.base_url}/health")
    assert (ready.status_code, ready.content) == (200, b"")
    assert httpx.get(f"{emu.base_url}/health_generate").status_code == 200
    log = emu.log()
    order = ["Load weight begin", "Load weight end", "KV Cache is allocated"]
    order += ["Uvicorn running on http://127.0.0.1:", "The server is fired up and ready to roll!"]
    positions = [log.index(line) for line in order]
    assert positions == sorted(positions)
    assert re.search(r"^\[\d{4}-\d\d-\d\d \d\d:\d\d:\d\d TP0\] Load weight begin", log, re.M)


def test_warning_log_level_hides_the_readiness_line(start_emulator: StartEmulator) -> None:
    emu = start_emulator("--log-level", "warning")
    assert "fired up" not in emu.log()


def test_models_and_model_info(client: httpx.Client) -> None:
    models = client.get("/v1/models").json()
    card = models["data"][0]
    assert models["object"] == "list"
    assert card | {"created": 0} == {
        "id": "test-model",
        "object": "model",
        "created": 0,
        "owned_by": "sglang",
        "root": "test-model",
        "parent": None,
        "max_model_len": 4096,
    }
    missing = client.get("/v1/models/nope")
    assert missing.status_code == 404
    assert missing.json() == {
        "error": {
            "message": "The model 'nope' does not exist",
            "type": "invalid_request_error",
            "param": "model",
            "code": "model_not_found",
        }
    }
    for path in ("/model_info", "/get_model_info"):
        info = client.get(path).json()
        assert set(info) == {
            "model_path",
            "tokenizer_path",
            "is_generation",
            "preferred_sampling_params",
            "weight_version",
            "has_image_understanding",
            "has_audio_understanding",
            "model_type",
            "architectures",
        }


def test_config_json_sets_architecture_and_context(start_emulator: StartEmulator) -> None:
    emu = start_emulator(ready=False)
    emu.proc.terminate()
    emu.proc.wait()
    model_dir = emu.log_path.parent / "model"
    model_dir.mkdir()
    config = {"architectures": ["Qwen3_5MoeForConditionalGeneration"], "model_type": "qwen3_5"}
    (model_dir / "config.json").write_text(json.dumps(config | {"max_position_embeddings": 9000}))
    emu = start_emulator("--model", str(model_dir), "--served-model-name", "m")
    info = httpx.get(f"{emu.base_url}/model_info").json()
    assert info["architectures"] == ["Qwen3_5MoeForConditionalGeneration"]
    assert httpx.get(f"{emu.base_url}/v1/models").json()["data"][0]["max_model_len"] == 9000


def test_server_info_spec_defaults_and_cap(client: httpx.Client) -> None:
    for path in ("/server_info", "/get_server_info"):
        info = client.get(path).json()
        assert info["speculative_algorithm"] == "EAGLE"
        steps = (info["speculative_num_steps"], info["speculative_eagle_topk"])
        assert steps + (info["speculative_num_draft_tokens"],) == (3, 1, 4)
        assert info["max_running_requests"] == 48
        assert info["tp_size"] == 2
        assert info["status"] == "ready"
        assert info["max_req_input_len"] == 4096 - 1 - 5
        assert {"max_total_num_tokens", "version", "speculative_draft_model_path"} <= set(info)
        assert isinstance(info["internal_states"], list) and len(info["internal_states"]) == 1
        state = info["internal_states"][0]
        assert state["effective_max_running_requests_per_dp"] == 48
        assert "last_gen_throughput" in state


def test_accept_length_appears_after_generating(start_emulator: StartEmulator) -> None:
    emu = start_emulator("--speculative-algorithm", "EAGLE")
    state = httpx.get(f"{emu.base_url}/server_info").json()["internal_states"][0]
    assert "avg_spec_accept_length" not in state
    body = {"text": "x", "sampling_params": {"max_new_tokens": 300, "ignore_eos": True}}
    meta = httpx.post(f"{emu.base_url}/generate", json=body).json()["meta_info"]
    assert meta["completion_tokens"] == 300
    assert 2.0 < meta["spec_accept_length"] < 3.2
    state = httpx.get(f"{emu.base_url}/server_info").json()["internal_states"][0]
    assert 2.0 < state["avg_spec_accept_length"] < 3.2


def test_chat_non_stream_shape(client: httpx.Client) -> None:
    r = chat(client, max_tokens=2000)
    assert r.status_code == 200
    body = r.json()
    assert re.fullmatch(r"[0-9a-f]{32}", body["id"])
    assert (body["object"], body["model"]) == ("chat.completion", "anything")
    assert body["metadata"] == {"weight_version": "default"}
    choice = body["choices"][0]
    assert set(choice) == {"index", "message", "logprobs", "finish_reason", "matched_stop"}
    assert choice["finish_reason"] == "stop" and choice["matched_stop"] is not None
    message = choice["message"]
    assert message["role"] == "assistant" and message["tool_calls"] is None
    assert isinstance(message["reasoning_content"], str) and isinstance(message["content"], str)
    usage = body["usage"]
    assert set(usage) == {
        "prompt_tokens",
        "total_tokens",
        "completion_tokens",
        "prompt_tokens_details",
        "reasoning_tokens",
    }
    assert usage["prompt_tokens_details"] is None
    assert 0 < usage["reasoning_tokens"] <= usage["completion_tokens"]
    assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]
    again = chat(client, max_tokens=2000).json()["usage"]
    assert again["completion_tokens"] == usage["completion_tokens"]  # derived from the prompt


def test_chat_length_and_thinking_off(client: httpx.Client) -> None:
    capped = chat(client, max_completion_tokens=3, max_tokens=1000).json()
    assert capped["choices"][0]["finish_reason"] == "length"
    assert capped["usage"]["completion_tokens"] == 3
    off = chat(client, max_tokens=2000, chat_template_kwargs={"enable_thinking": False}).json()
    assert off["choices"][0]["message"]["reasoning_content"] is None
    assert off["choices"][0]["message"]["content"]
    assert off["usage"]["reasoning_tokens"] == 0


def test_chat_stream_format(client: httpx.Client) -> None:
    body = {
        "messages": [{"role": "user", "content": "stream me"}],
        "stream": True,
        "stream_options": {"include_usage": True},
        "max_tokens": 2000,
    }
    with client.stream("POST", "/v1/chat/completions", json=body) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        events = sse_events(r)
    assert events[-1] == "[DONE]"
    chunks = events[:-1]
    first = chunks[0]["choices"][0]
    assert first["delta"] == {"role": "assistant", "content": "", "reasoning_content": None}
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)
    deltas = [c["choices"][0]["delta"] for c in chunks if c["choices"]]
    assert all("reasoning_content" in d for d in deltas)
    finish = [c for c in chunks if c["choices"] and c["choices"][0]["finish_reason"]]
    assert len(finish) == 1 and finish[0]["choices"][0]["finish_reason"] == "stop"
    usage_chunk = chunks[-1]
    assert usage_chunk["choices"] == [] and usage_chunk["usage"]["completion_tokens"] > 0


def test_chat_stream_interval_and_continuous_usage(start_emulator: StartEmulator) -> None:
    """`--stream-interval 16` (no MTP: one token a step): text chunks at least 16 tokens
    apart, each with the usage so far under `continuous_usage_stats`; the final usage chunk
    as before."""
    emulator = start_emulator("--reasoning-parser", "qwen3", "--stream-interval", "16")
    body = {
        "messages": [{"role": "user", "content": "stream me in sixteens"}],
        "stream": True,
        "stream_options": {"include_usage": True, "continuous_usage_stats": True},
        "max_tokens": 400,
        "ignore_eos": True,
    }
    with httpx.Client(base_url=emulator.base_url, timeout=10) as c:
        with c.stream("POST", "/v1/chat/completions", json=body) as r:
            events = sse_events(r)
    assert events[-1] == "[DONE]"
    texts = [
        e for e in events[:-1] if e["choices"] and set(e["choices"][0]["delta"]) - {"role"}
        and (e["choices"][0]["delta"].get("content") or e["choices"][0]["delta"].get(
            "reasoning_content"))
    ]  # fmt: skip
    counts = [e["usage"]["completion_tokens"] for e in texts]
    assert counts == sorted(counts) and counts[-1] == 400
    # At most one write per 16 tokens (a write may hold a reasoning and a content chunk; a
    # busy event loop coalesces more), where the default interval writes after every token.
    assert len(set(counts)) <= 400 // 16 + 1
    assert events[-2]["choices"] == [] and events[-2]["usage"]["completion_tokens"] == 400


def test_generate_non_stream_and_stream(client: httpx.Client) -> None:
    body: dict[str, Any] = {"text": "The capital city of France is"}
    one = client.post("/generate", json=body).json()
    assert set(one) == {"text", "output_ids", "meta_info"}
    meta = one["meta_info"]
    assert meta["finish_reason"]["type"] in {"stop", "length"}
    assert meta["spec_verify_ct"] > 0 and "e2e_latency" in meta
    assert len(one["output_ids"]) == meta["completion_tokens"]
    batch = client.post("/generate", json={"text": ["a", "b"]}).json()
    assert isinstance(batch, list) and len(batch) == 2
    body |= {"stream": True, "sampling_params": {"max_new_tokens": 30, "ignore_eos": True}}
    with client.stream("POST", "/generate", json=body) as r:
        events = sse_events(r)
    assert events[-1] == "[DONE]"
    chunks = events[:-1]
    texts = [c["text"] for c in chunks]
    assert all(b.startswith(a) for a, b in zip(texts, texts[1:], strict=False))
    assert [c["meta_info"]["completion_tokens"] for c in chunks][-1] == 30
    assert all("spec_verify_ct" not in c["meta_info"] for c in chunks[:-1])
    assert chunks[-1]["meta_info"]["finish_reason"] == {"type": "length", "length": 30}
    assert "spec_accept_length" in chunks[-1]["meta_info"]


@pytest.mark.parametrize(
    ("raw", "headers", "message"),
    [
        (b"{not json", {"Content-Type": "application/json"}, "JSON decode error"),
        (b"{}", {"Content-Type": "text/plain"}, "Only 'application/json' is allowed"),
        (b'{"messages": []}', {"Content-Type": "application/json"}, "Messages cannot be empty."),
        (
            b'{"messages": [{"role": "user", "content": "x"}], "top_p": 1.5}',
            {"Content-Type": "application/json"},
            "top_p must be in (0, 1], got 1.5",
        ),
    ],
)
def test_validation_errors_are_400_a(
    client: httpx.Client, raw: bytes, headers: dict[str, str], message: str
) -> None:
    r = client.post("/v1/chat/completions", content=raw, headers=headers)
    assert r.status_code == 400
    body = r.json()
    assert set(body) == ERROR_A_KEYS and body["object"] == "error" and body["code"] == 400
    assert message in body["message"]


def test_context_errors(client: httpx.Client) -> None:
    long = "x" * 4 * 4100
    prompt_tokens = 4100 + 4 + 3  # text + message overhead + assistant header
    r = chat(client, long)
    assert r.status_code == 400
    assert r.json()["message"] == (
        f"The input ({prompt_tokens + 4} tokens) is longer than the model's context "
        "length (4096 tokens)."
    )
    assert r.json()["type"] == "BadRequestError"
    streamed = chat(client, long, stream=True)
    assert streamed.status_code == 400
    r = chat(client, "hi", max_tokens=4090)
    assert r.status_code == 400
    n = 1 + 4 + 3 + 4
    assert r.json()["message"].startswith(
        "Requested token count exceeds the model's maximum context length of 4096 tokens. "
        f"You requested a total of {4090 + n} tokens: {n} tokens from the input messages and "
        "4090 tokens for the completion."
    )
    r = chat(client, "hi", max_tokens=5000)
    assert r.json()["message"] == (
        "max_completion_tokens is too large: 5000.This model supports at most 4096 "
        "completion tokens."
    )
    gen = client.post("/generate", json={"text": long})
    assert gen.status_code == 400 and set(gen.json()) == {"error"}
    with client.stream("POST", "/generate", json={"text": long, "stream": True}) as s:
        assert s.status_code == 200
        events = sse_events(s)
    assert events[0]["error"]["code"] == 400 and events[-1] == "[DONE]"


def test_metrics_names(client: httpx.Client) -> None:
    chat(client, max_tokens=20)
    text = client.get("/metrics").text
    for name in (
        "num_running_reqs",
        "num_queue_reqs",
        "gen_throughput",
        "spec_accept_length",
        "context_len",
    ):
        assert re.search(
            rf'^sglang:{name}\{{engine_type="unified",model_name="test-model",moe_ep_rank="0",'
            rf'pp_rank="0",tp_rank="0"\}} [0-9.e+-]+$',
            text,
            re.M,
        ), name
    for name in ("prompt_tokens_total", "generation_tokens_total", "num_requests_total"):
        assert f"# TYPE sglang:{name} counter" in text
        assert re.search(
            rf'^sglang:{name}\{{engine_type="unified",model_name="test-model"\}} ', text, re.M
        )
    assert client.post("/flush_cache").text.startswith("Cache flushed.")


def test_cap_of_48_and_power_rising(start_emulator: StartEmulator) -> None:
    slow = {"GENFLEET_EMULATOR_TIME_SCALE": "1", "GENFLEET_EMULATOR_STEP_BASE_MS": "20"}
    emu = start_emulator("--speculative-algorithm", "NEXTN", "--enable-metrics", env=slow)
    limits = httpx.Limits(max_connections=200)
    with httpx.Client(base_url=emu.base_url, timeout=10, limits=limits) as c:
        idle = c.get("/genfleet/power").json()["gpus"][0]
        assert idle["power_w"] == 80.0 and idle["running"] == 0
        body = {"text": "go", "stream": True}
        body["sampling_params"] = {"max_new_tokens": 3000, "ignore_eos": True}
        with contextlib.ExitStack() as streams:
            streams.enter_context(c.stream("POST", "/generate", json=body))
            one = c.get("/genfleet/power").json()["gpus"][0]
            for _ in range(59):
                streams.enter_context(c.stream("POST", "/generate", json=body))
            power = c.get("/genfleet/power").json()
            gpu = power["gpus"][0]
            assert (gpu["running"], gpu["queued"]) == (48, 12)
            assert idle["power_w"] < one["power_w"] < gpu["power_w"]
            assert gpu["power_w"] == pytest.approx(0.95 * 700, rel=0.01)
            assert gpu["energy_j"] > one["energy_j"]
            assert set(gpu) == {
                "gpu_uuid",
                "gpu_name",
                "power_w",
                "power_limit_w",
                "default_power_limit_w",
                "energy_j",
                "utilization_pct",
                "memory_used_mib",
                "memory_total_mib",
                "sm_clock_mhz",
                "temperature_c",
                "running",
                "queued",
            }
            assert gpu["gpu_uuid"] == f"EMU-{emu.port}-0"
            metrics = c.get("/metrics").text
            assert re.search(r"^sglang:num_running_reqs\{.*\} 48\.0$", metrics, re.M)
            assert re.search(r"^sglang:num_queue_reqs\{.*\} 12\.0$", metrics, re.M)
        wait_for(
            lambda: c.get("/genfleet/power").json()["gpus"][0]["running"] == 0,
            10,
            "no request running",
        )


def test_queue_limit_gives_503(start_emulator: StartEmulator) -> None:
    slow = {"GENFLEET_EMULATOR_TIME_SCALE": "1"}
    flags = ("--max-running-requests", "1", "--max-queued-requests", "1")
    emu = start_emulator(*flags, env=slow)
    body = {
        "messages": [{"role": "user", "content": "x"}],
        "stream": True,
        "max_tokens": 3000,
        "ignore_eos": True,
    }
    with httpx.Client(base_url=emu.base_url, timeout=10) as c, contextlib.ExitStack() as streams:
        streams.enter_context(c.stream("POST", "/v1/chat/completions", json=body))
        streams.enter_context(c.stream("POST", "/v1/chat/completions", json=body))
        r = c.post("/v1/chat/completions", json=body | {"stream": False})
        assert r.status_code == 503
        assert r.json()["message"] == "The request queue is full."
        with c.stream("POST", "/v1/chat/completions", json=body) as s:
            assert s.status_code == 200
            events = sse_events(s)
        assert events[0]["error"]["type"] == "SERVICE_UNAVAILABLE"


def test_api_key(start_emulator: StartEmulator) -> None:
    emu = start_emulator("--api-key", "sekret")
    assert httpx.get(f"{emu.base_url}/health").status_code == 200
    denied = httpx.get(f"{emu.base_url}/v1/models")
    assert (denied.status_code, denied.json()) == (401, {"error": "Unauthorized"})
    auth = {"Authorization": "Bearer sekret"}
    assert httpx.get(f"{emu.base_url}/v1/models", headers=auth).status_code == 200
    assert httpx.get(f"{emu.base_url}/metrics").status_code == 404  # no --enable-metrics
    assert httpx.get(f"{emu.base_url}/server_info", headers=auth).json()["api_key"] == "***"


def test_api_key_from_the_config_file(start_emulator: StartEmulator, tmp_path: Path) -> None:
    """`--config file.yaml` as SGLang merges it (genfleet writes a JSON object, which is YAML):
    the key reaches the engine without being on its argv."""
    config = tmp_path / "engine.yaml"
    config.write_text(json.dumps({"api-key": "from-file"}))
    emu = start_emulator("--config", str(config))
    assert httpx.get(f"{emu.base_url}/v1/models").status_code == 401
    auth = {"Authorization": "Bearer from-file"}
    assert httpx.get(f"{emu.base_url}/v1/models", headers=auth).status_code == 200


def test_fail_after_requests_kills_the_process(start_emulator: StartEmulator) -> None:
    emu = start_emulator(env={"GENFLEET_EMULATOR_FAIL_AFTER_REQUESTS": "2"})
    first = httpx.post(f"{emu.base_url}/generate", json={"text": "a"})
    assert first.status_code == 200
    with pytest.raises(httpx.TransportError):
        httpx.post(f"{emu.base_url}/generate", json={"text": "b"})
    assert emu.proc.wait(timeout=5) == 1


def test_sigterm_mid_stream_exits_promptly(start_emulator: StartEmulator) -> None:
    emu = start_emulator(env={"GENFLEET_EMULATOR_TIME_SCALE": "1"})
    body = {"text": "x", "stream": True}
    body["sampling_params"] = {"max_new_tokens": 3000, "ignore_eos": True}
    with httpx.Client(base_url=emu.base_url, timeout=10) as c:
        with c.stream("POST", "/generate", json=body) as s:
            assert s.status_code == 200
            emu.proc.terminate()
            assert emu.proc.wait(timeout=5) == 0
            with pytest.raises(httpx.TransportError):
                s.read()
