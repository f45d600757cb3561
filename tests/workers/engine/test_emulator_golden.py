"""The emulator against what real SGLang 0.5.15 answered (tests/golden/sglang-0.5.15/).

The golden files were recorded on an H200 by `bench/real_sglang/record_golden.py` (genfleet's
own argv and supervisor, MTP on, the qwen3 reasoning parser, an API key). Here the emulator is
started with the same flags, asked the same things, and its answers compared with SGLang's:
the same status codes and content types, the same JSON shapes (keys and value types, every
level), the same error messages up to the numbers in them, the same stream framing, metric
names and labels SGLang also has. A difference fails here: fix the emulator (or re-record, on
a new SGLang release, and say so in the golden README).
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.support.emulator import Emulator, StartEmulator

pytestmark = pytest.mark.integration

GOLDEN = Path(__file__).resolve().parents[2] / "golden" / "sglang-0.5.15"
KEY = "golden-key"
AUTH = {"Authorization": f"Bearer {KEY}"}


def golden(name: str) -> Any:
    return json.loads((GOLDEN / name).read_text())


def recorded_flags() -> list[str]:
    """The engine flags SGLang was started with, less program, model, host and port."""
    argv: list[str] = golden("argv.json")[2:]
    flags: list[str] = []
    skip = {"--model-path", "--host", "--port"}
    i = 0
    while i < len(argv):
        if argv[i] in skip:
            i += 2
            continue
        flags.append(argv[i])
        i += 1
    return flags


def shape(value: Any) -> Any:
    """Keys and value types at every level; a list by its first item."""
    if isinstance(value, dict):
        return {k: shape(v) for k, v in sorted(value.items())}
    if isinstance(value, list):
        return [shape(value[0])] if value else []
    if isinstance(value, bool) or value is None:
        return repr(value) if value is None else "bool"
    if isinstance(value, int | float):
        return "number"
    return type(value).__name__


def numbers_out(text: str) -> str:
    return re.sub(r"\d+(\.\d+)?", "N", text)


def sse(text: str) -> list[Any]:
    events: list[Any] = []
    for line in text.splitlines():
        if line.startswith("data: "):
            data = line[len("data: ") :]
            events.append(data if data == "[DONE]" else json.loads(data))
    return events


@pytest.fixture(scope="module")
def emu(start_emulator: StartEmulator) -> Emulator:
    flags = [*recorded_flags(), "--api-key", KEY]
    return start_emulator(*flags, env={"GENFLEET_EMULATOR_MEAN_COMPLETION_TOKENS": "400"})


@pytest.fixture(scope="module")
def client(emu: Emulator) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=emu.base_url, headers=AUTH, timeout=30) as c:
        yield c


def chat_body(content: str = "Explain hash maps in 20 words.", **extra: Any) -> dict[str, Any]:
    return {"messages": [{"role": "user", "content": content}], "max_tokens": 48, **extra}


@pytest.mark.parametrize(
    ("name", "extra"),
    [
        ("chat.json", {}),
        ("chat_length.json", {"max_completion_tokens": 3}),
        ("chat_thinking_off.json", {"chat_template_kwargs": {"enable_thinking": False}}),
    ],
)
def test_chat_completion_bodies(client: httpx.Client, name: str, extra: dict[str, Any]) -> None:
    real = golden(name)
    r = client.post("/v1/chat/completions", json=chat_body(**extra))
    assert (r.status_code, r.headers["content-type"]) == (real["status"], real["content_type"])
    body = r.json()
    assert shape(body) == shape(real["body"])
    choice, real_choice = body["choices"][0], real["body"]["choices"][0]
    assert choice["finish_reason"] == real_choice["finish_reason"]
    usage, real_usage = body["usage"], real["body"]["usage"]
    assert (usage["reasoning_tokens"] > 0) == (real_usage["reasoning_tokens"] > 0)
    assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]
    message, real_message = choice["message"], real_choice["message"]
    assert (message["reasoning_content"] is None) == (real_message["reasoning_content"] is None)


def test_chat_stream_framing(client: httpx.Client) -> None:
    real = sse((GOLDEN / "chat_stream.sse").read_text())
    headers = golden("chat_stream_headers.json")
    body = chat_body(stream=True, stream_options={"include_usage": True})
    with client.stream("POST", "/v1/chat/completions", json=body) as r:
        assert r.status_code == headers["status"]
        assert r.headers["content-type"] == headers["content_type"]
        ours = sse(r.read().decode())
    assert ours[-1] == real[-1] == "[DONE]"
    ours, real = ours[:-1], real[:-1]
    assert shape(ours[0]) == shape(real[0])  # the role chunk
    assert ours[0]["choices"][0]["delta"] == real[0]["choices"][0]["delta"]
    # a reasoning delta, the finish chunk, then the usage chunk with no choices
    assert shape(ours[1]) == shape(real[1])
    assert shape(ours[-2]) == shape(real[-2])
    assert ours[-2]["choices"][0]["delta"] == real[-2]["choices"][0]["delta"]
    assert shape(ours[-1]) == shape(real[-1]) and ours[-1]["choices"] == []
    finishing = [c for c in ours if c["choices"] and c["choices"][0]["finish_reason"]]
    assert len(finishing) == 1
    middle = {json.dumps(shape(c)) for c in real[1:-2]}
    assert {json.dumps(shape(c)) for c in ours[1:-2]} <= middle


def test_generate_bodies(client: httpx.Client) -> None:
    body = {"text": "The capital of France is", "sampling_params": {"max_new_tokens": 16}}
    real = golden("generate.json")["body"]
    ours = client.post("/generate", json=body).json()
    assert set(ours) == set(real)
    # Sent only once the scheduler stamped them (`> 0.0` in req_time_stats.py): this run never did.
    newer = {"forward_entry_time", "prefill_finished_time"}
    assert set(ours["meta_info"]) - newer <= set(real["meta_info"])
    missing = set(real["meta_info"]) - set(ours["meta_info"])
    genfleet_reads = {"completion_tokens", "prompt_tokens", "finish_reason", "spec_verify_ct"}
    assert not missing & (genfleet_reads | {"spec_accept_length", "e2e_latency"}), missing
    assert shape(ours["meta_info"]["finish_reason"]) == shape(real["meta_info"]["finish_reason"])
    real_stream = sse((GOLDEN / "generate_stream.sse").read_text())
    with client.stream("POST", "/generate", json=body | {"stream": True}) as r:
        stream = sse(r.read().decode())
    assert stream[-1] == real_stream[-1] == "[DONE]"
    assert set(stream[0]) == set(real_stream[0])
    assert stream[-2]["meta_info"]["finish_reason"] == real_stream[-2]["meta_info"]["finish_reason"]


REQUESTS: dict[str, tuple[str, str, dict[str, Any]]] = {
    "bad_json": ("POST", "/v1/chat/completions", {"content": b"{not json"}),
    "wrong_content_type": (
        "POST",
        "/v1/chat/completions",
        {"content": b"{}", "headers": {"Content-Type": "text/plain", **AUTH}},
    ),
    "empty_messages": ("POST", "/v1/chat/completions", {"json": {"messages": []}}),
    "top_p_out_of_range": ("POST", "/v1/chat/completions", {"json": chat_body(top_p=1.5)}),
    "unknown_model": ("POST", "/v1/chat/completions", {"json": chat_body(model="nope")}),
    "too_long": ("POST", "/v1/chat/completions", {"json": chat_body("hash " * 65536)}),
    "too_long_stream": (
        "POST",
        "/v1/chat/completions",
        {"json": chat_body("hash " * 65536, stream=True)},
    ),
    "max_tokens_over_context": (
        "POST",
        "/v1/chat/completions",
        {"json": chat_body(max_tokens=32868)},
    ),
    "generate_too_long": ("POST", "/generate", {"json": {"text": "hash " * 65536}}),
    "wrong_key_chat": (
        "POST",
        "/v1/chat/completions",
        {"json": chat_body(), "headers": {"Authorization": "Bearer wrong"}},
    ),
    "wrong_key_models": ("GET", "/v1/models", {"headers": {"Authorization": "Bearer wrong"}}),
    "no_key_models": ("GET", "/v1/models", {"headers": {"Authorization": ""}}),
    "wrong_key_health": ("GET", "/health", {"headers": {"Authorization": "Bearer wrong"}}),
    "wrong_key_metrics": ("GET", "/metrics", {"headers": {"Authorization": "Bearer wrong"}}),
}


@pytest.mark.parametrize("name", sorted(REQUESTS))
def test_error_answers(client: httpx.Client, name: str) -> None:
    real = golden("errors.json")[name]
    method, path, kwargs = REQUESTS[name]
    if "content" in kwargs and "headers" not in kwargs:
        kwargs = {**kwargs, "headers": {"Content-Type": "application/json", **AUTH}}
    r = client.request(method, path, **kwargs)
    assert r.status_code == real["status"], r.text[:500]
    assert r.headers.get("content-type") == real["content_type"]
    if real["content_type"] != "application/json":
        return
    ours = r.json()
    if name == "unknown_model":  # SGLang serves its one model whatever the name says
        assert shape(ours) == shape(real["body"])
        return
    assert shape(ours) == shape(real["body"])
    if isinstance(real["body"], dict) and "message" in real["body"]:
        assert numbers_out(ours["message"]) == numbers_out(real["body"]["message"])
        assert ours["type"] == real["body"]["type"]
    else:
        assert numbers_out(json.dumps(ours)) == numbers_out(json.dumps(real["body"]))


def test_models_and_model_info(client: httpx.Client) -> None:
    real = golden("models.json")
    for name, path in (
        ("v1_models", "/v1/models"),
        ("model_info", "/model_info"),
        ("v1_models_missing", "/v1/models/nope"),
    ):
        r = client.get(path)
        assert r.status_code == real[name]["status"]
        assert shape(r.json()) == shape(real[name]["body"]), name
    missing = client.get("/v1/models/nope").json()
    assert missing == real["v1_models_missing"]["body"]


def test_server_info_keys_sglang_has(client: httpx.Client) -> None:
    """Every key the emulator reports, SGLang reports too (nothing invented), with the same
    type; and the ones genfleet reads carry the same values for the same flags."""
    real = golden("server_info.json")
    ours = client.get("/server_info").json()
    invented = set(ours) - set(real)
    assert not invented, sorted(invented)
    for key in ours:
        if ours[key] is not None and real[key] is not None:
            assert type(ours[key]) is type(real[key]), key
    for key in (
        "speculative_algorithm",
        "speculative_num_steps",
        "speculative_eagle_topk",
        "speculative_num_draft_tokens",
        "max_running_requests",
        "tp_size",
        "enable_metrics",
        "max_queued_requests",
        "reasoning_parser",
    ):
        assert ours.get(key) == real.get(key), key
    # SGLang adds the accept length once it has generated: compare with the one under load.
    busy = golden("server_info_busy.json")
    state, real_state = ours["internal_states"][0], busy["internal_states"][0]
    invented = set(state) - set(real_state)
    assert not invented, sorted(invented)
    genfleet_reads = {"effective_max_running_requests_per_dp", "avg_spec_accept_length"}
    assert genfleet_reads <= set(real_state)
    assert (
        state["effective_max_running_requests_per_dp"]
        == (real_state["effective_max_running_requests_per_dp"])
    )


def metric_families(text: str) -> dict[str, tuple[str, frozenset[str]]]:
    """name -> (type, label names) of a Prometheus text exposition."""
    types: dict[str, str] = {}
    found: dict[str, tuple[str, frozenset[str]]] = {}
    for line in text.splitlines():
        if line.startswith("# TYPE "):
            _, _, name, kind = line.split(" ", 3)
            types[name] = kind
        elif line and not line.startswith("#"):
            name, _, rest = line.partition("{")
            labels = frozenset(re.findall(r'(\w+)="', rest.split("}")[0])) if rest else frozenset()
            base = re.sub(r"_(bucket|sum|count|total|created)$", "", name)
            kind = types.get(name) or types.get(base) or "untyped"
            found.setdefault(name.split(" ")[0], (kind, labels))
    return found


def test_metrics_names_types_and_labels(client: httpx.Client) -> None:
    client.post("/v1/chat/completions", json=chat_body())
    real = metric_families((GOLDEN / "metrics.prom").read_text())
    ours = metric_families(client.get("/metrics").text)
    invented = sorted(n for n in ours if n.startswith("sglang:") and n not in real)
    assert not invented, invented
    for name, (kind, labels) in ours.items():
        if name in real:
            assert (kind, labels) == real[name], name
    for name in ("sglang:num_running_reqs", "sglang:num_queue_reqs", "sglang:spec_accept_length"):
        assert name in ours and name in real


def test_health_through_start_and_after_load(start_emulator: StartEmulator) -> None:
    """SGLang: connection refused while loading, 503 with an empty body while warming up, then
    200 with an empty body (during load too, and after)."""
    seen = [change["health"][0] for change in golden("health_startup.json")["changes"]]
    assert seen == [None, 503, 200]
    assert all(h["status"] == 200 and h["body"] == "" for h in golden("health_under_load.json"))
    slow = {"GENFLEET_EMULATOR_LOAD_S": "0.5", "GENFLEET_EMULATOR_WARMUP_S": "0.5"}
    emu = start_emulator(*recorded_flags(), env=slow, ready=False)
    observed: list[int | None] = []
    while not observed or observed[-1] != 200:
        status = emu.health_status()
        if not observed or observed[-1] != status:
            observed.append(status)
    assert observed == seen
    after = golden("health_after.json")
    r = httpx.get(f"{emu.base_url}/health")
    assert (r.status_code, r.text) == (after["health"]["status"], after["health"]["body"])
    assert r.headers.get("content-type") == after["health"]["content_type"]
