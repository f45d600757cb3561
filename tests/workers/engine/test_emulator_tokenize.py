"""/v1/tokenize and the token-exact continuation of /generate, against real emulator processes
started on model directories holding published chat templates (tests/data/chat_templates/).

The contract the workers rely on: render a chat to ids with /v1/tokenize, stream /generate
with those ids; after a cut at any k, `/generate` with the prompt ids plus the first k output
ids and `max_new_tokens = M - k` streams exactly the rest (ids and text), with the same finish.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from itertools import accumulate
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest

from tests.support.chat_templates import DEEPSEEK, checkpoint
from tests.support.emulator import Emulator, StartEmulator

pytestmark = pytest.mark.integration

KEY = "tokenize-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
THINK, END_THINK, IM_START, IM_END = 151667, 151668, 151644, 151645
# DeepSeek's EOS has no id in a checkpoint without added_tokens_decoder: the emulator's own.
EOS_IDS = {"qwen3": IM_END, "qwen3_5": IM_END, "deepseek_v3_1": 151670}
CHATS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [
        {"role": "system", "content": "You answer in one short paragraph."},
        {"role": "user", "content": "Explain why the sky is blue."},
        {"role": "assistant", "content": "Because of Rayleigh scattering."},
        {"role": "user", "content": [{"type": "text", "text": "Say more about it, please."}]},
    ],
]


@pytest.fixture(scope="module")
def engines(
    start_emulator: StartEmulator, tmp_path_factory: pytest.TempPathFactory
) -> dict[str, Emulator]:
    """Qwen3 (an API key), Qwen3.5 (incremental streams) and DeepSeek-V3.1 (with loops and
    legitimately repetitive answers among its answers)."""
    root = tmp_path_factory.mktemp("checkpoints")
    kinds = {"GENFLEET_EMULATOR_LOOP_RATE": "0.4", "GENFLEET_EMULATOR_LEGIT_REPEAT_RATE": "0.4"}
    return {
        "qwen3": start_emulator("--model-path", checkpoint(root, "qwen3"), "--api-key", KEY),
        "qwen3_5": start_emulator(
            "--model-path", checkpoint(root, "qwen3_5"), "--incremental-streaming-output"
        ),
        "deepseek_v3_1": start_emulator(
            "--model-path", checkpoint(root, "deepseek_v3_1", DEEPSEEK), env=kinds
        ),
    }


@pytest.fixture(scope="module")
def clients(engines: dict[str, Emulator]) -> Iterator[dict[str, httpx.Client]]:
    made = {
        name: httpx.Client(base_url=emu.base_url, timeout=20, headers=AUTH)
        for name, emu in engines.items()
    }
    yield made
    for client in made.values():
        client.close()


def thinking_kwargs(name: str, on: bool) -> dict[str, bool]:
    return {"thinking": on} if name == "deepseek_v3_1" else {"enable_thinking": on}


def tokenize(client: httpx.Client, messages: Any, **extra: Any) -> list[int]:
    r = client.post("/v1/tokenize", json={"model": "m", "messages": messages, **extra})
    assert r.status_code == 200, r.text
    body = r.json()
    assert set(body) == {"tokens", "count", "max_model_len"}
    assert body["count"] == len(body["tokens"])
    tokens: list[int] = body["tokens"]
    return tokens


def stream(client: httpx.Client, ids: list[int], max_new: int) -> dict[str, Any]:
    """Stream /generate; the whole answer (ids, text) from cumulative or incremental chunks."""
    body = {"input_ids": ids, "stream": True, "sampling_params": {"max_new_tokens": max_new}}
    ids_out: list[int] = []
    text = ""
    chunks: list[dict[str, Any]] = []
    with client.stream("POST", "/generate", json=body) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[len("data: ") :])
            chunks.append(chunk)
    incremental = client.get("/server_info").json()["incremental_streaming_output"]
    for chunk in chunks:
        if incremental:
            ids_out += chunk["output_ids"]
            text += chunk["text"]
        else:
            ids_out, text = chunk["output_ids"], chunk["text"]
    meta = chunks[-1]["meta_info"]
    assert all(c["meta_info"]["finish_reason"] is None for c in chunks[:-1])
    assert meta["completion_tokens"] == len(ids_out)
    return {"ids": ids_out, "text": text, "meta": meta, "chunks": chunks}


def detokenize(client: httpx.Client, ids: list[int]) -> str:
    r = client.post("/v1/detokenize", json={"tokens": ids, "skip_special_tokens": False})
    assert r.status_code == 200, r.text
    text: str = r.json()["text"]
    return text


@pytest.mark.parametrize(
    ("name", "on", "tail"),
    [
        ("qwen3", True, [IM_START, "assistant", "\n"]),  # the header alone
        ("qwen3", False, [THINK, "\n\n", END_THINK, "\n\n"]),  # a closed empty block
        ("qwen3_5", True, [IM_START, "assistant", "\n", THINK, "\n"]),  # <think> opened
        ("qwen3_5", False, [THINK, "\n\n", END_THINK, "\n\n"]),
        ("deepseek_v3_1", True, ["<｜Assistant｜>", THINK]),
        ("deepseek_v3_1", False, ["<｜Assistant｜>", END_THINK]),
    ],
)
def test_tokenize_renders_the_checkpoints_template(
    clients: dict[str, httpx.Client], name: str, on: bool, tail: list[int | str]
) -> None:
    client = clients[name]
    ids = tokenize(client, CHATS[1], chat_template_kwargs=thinking_kwargs(name, on))
    last = ids[-len(tail) :]
    seen = [
        detokenize(client, [i]) if isinstance(t, str) else i
        for t, i in zip(tail, last, strict=True)
    ]
    assert seen == tail  # each special one id, each piece of text one id
    text = detokenize(client, ids)
    if name == "deepseek_v3_1":
        assert text.startswith("<｜begin▁of▁sentence｜>You answer in one short paragraph.")
        assert text.endswith("<｜Assistant｜><think>" if on else "<｜Assistant｜></think>")
    else:
        assert text.startswith("<|im_start|>system\nYou answer in one short paragraph.")
        assert "<|im_start|>user\nSay more about it, please.<|im_end|>\n" in text
    assert client.post("/tokenize", json={"messages": CHATS[0]}).status_code == 200


@pytest.mark.parametrize("name", ["qwen3", "qwen3_5", "deepseek_v3_1"])
@pytest.mark.parametrize("on", [True, False])
def test_a_continuation_writes_exactly_the_rest(
    clients: dict[str, httpx.Client], name: str, on: bool
) -> None:
    client = clients[name]
    kwargs = thinking_kwargs(name, on)
    for chat, max_new in zip(CHATS, (400, 30), strict=True):  # a natural stop, then a cut
        prompt = tokenize(client, chat, chat_template_kwargs=kwargs)
        whole = stream(client, prompt, max_new)
        ids, n = whole["ids"], len(whole["ids"])
        assert n > 0 and whole["meta"]["prompt_tokens"] == len(prompt)
        assert "".join(detokenize(client, [t]) for t in ids) == whole["text"]
        ends = {i for i, t in enumerate(ids) if t == END_THINK}
        for k in sorted({0, 1, 2, n // 2, n - 1} | ends | {e + 1 for e in ends}):
            if not 0 <= k < n:
                continue
            rest = stream(client, prompt + ids[:k], max_new - k)
            assert ids[:k] + rest["ids"] == ids, (name, on, k)
            assert detokenize(client, ids[:k]) + rest["text"] == whole["text"]
            finish = dict(whole["meta"]["finish_reason"])
            if finish["type"] == "length":  # SGLang's `length` is this request's cap
                finish["length"] -= k
            assert rest["meta"]["finish_reason"] == finish
            assert rest["meta"]["prompt_tokens"] == len(prompt) + k
            assert rest["meta"]["completion_tokens"] == n - k
        assert_structure(name, on, whole)


def assert_structure(name: str, on: bool, whole: dict[str, Any]) -> None:
    """Thinking on: Qwen3 writes <think> first, the others start reasoning; the reasoning ends
    with the one </think> id; off: content only. Never an EOS or another special id."""
    ids, text, finish = whole["ids"], whole["text"], whole["meta"]["finish_reason"]
    assert not {t for t in ids if t >= 151643} - {THINK, END_THINK}
    eos = EOS_IDS[name]
    assert finish == {"type": "stop", "matched": eos} or finish["type"] == "length"
    if not on:
        assert THINK not in ids and END_THINK not in ids
        return
    assert (ids[0] == THINK) == (name == "qwen3") and THINK not in ids[1:]
    if END_THINK in ids:  # not when the cut comes first (or a loop never leaves it)
        after = text.split("</think>", 1)[1]
        assert ids.count(END_THINK) == 1
        assert after == "" or after.startswith("\n\n") == name.startswith("qwen3")
    elif name != "deepseek_v3_1":
        assert finish["type"] == "length"


def test_a_looping_answer_loops_on_in_its_continuation(clients: dict[str, httpx.Client]) -> None:
    """A loop never leaves its reasoning and runs to the cap; cut inside the loop, the
    continuation goes on repeating the same block from the same place."""
    client = clients["deepseek_v3_1"]
    size = 4000  # a loop starts by token 1,200 and repeats a block of at most 375 tokens
    for i in range(20):
        chat = [{"role": "user", "content": f"Tell me everything about item {i}."}]
        prompt = tokenize(client, chat, chat_template_kwargs={"thinking": True})
        whole = generate(client, prompt, size)
        if whole["meta_info"]["finish_reason"]["type"] == "length":
            break
    else:
        pytest.fail("no looping answer among 20 prompts at a loop rate of 0.4")
    ids, text = whole["output_ids"], whole["text"]
    assert END_THINK not in ids and len(ids) == size
    assert text.count(text[-1600:]) > 1  # the end is a block seen before
    for k in (2000, size - 1):
        rest = generate(client, prompt + ids[:k], size - k)
        assert ids[:k] + rest["output_ids"] == ids
        assert detokenize(client, ids[:k]) + rest["text"] == text


def generate(client: httpx.Client, ids: list[int], max_new: int) -> dict[str, Any]:
    body = {"input_ids": ids, "sampling_params": {"max_new_tokens": max_new}}
    r = client.post("/generate", json=body)
    assert r.status_code == 200, r.text
    answer: dict[str, Any] = r.json()
    return answer


def test_incremental_streams_carry_only_what_is_new(clients: dict[str, httpx.Client]) -> None:
    client = clients["qwen3_5"]
    prompt = tokenize(client, CHATS[0])
    # A stream of more than one chunk: at 100 times its pace the emulator draws this 16-token
    # answer in 2 ms, and on a loaded machine its handler may find all of it at once and send
    # it whole (seen once in a full suite run): ask again, a few times.
    for _ in range(5):
        whole = stream(client, prompt, 200)
        chunks = whole["chunks"]
        if len(chunks) > 1:
            break
    assert len(chunks) > 1
    assert sum(len(c["output_ids"]) for c in chunks) == whole["meta"]["completion_tokens"]
    counts = list(accumulate(len(c["output_ids"]) for c in chunks))
    assert [c["meta_info"]["completion_tokens"] for c in chunks] == counts
    assert all(c["text"] == "".join(detokenize(client, [i]) for i in c["output_ids"])
               for c in chunks[:5])  # fmt: skip
    body = {"input_ids": prompt, "sampling_params": {"max_new_tokens": 200}}
    once = client.post("/generate", json=body).json()
    assert (once["output_ids"], once["text"]) == (whole["ids"], whole["text"])


def test_chat_streams_the_same_answer_with_incremental_output(
    clients: dict[str, httpx.Client],
) -> None:
    client = clients["qwen3_5"]
    body = {"messages": CHATS[0], "max_tokens": 300}
    whole = client.post("/v1/chat/completions", json=body).json()["choices"][0]["message"]
    content = ""
    with client.stream("POST", "/v1/chat/completions", json=body | {"stream": True}) as r:
        for line in r.iter_lines():
            if line.startswith("data: {"):
                delta = json.loads(line[6:])["choices"][0]["delta"]
                content += (delta.get("reasoning_content") or "") + (delta.get("content") or "")
    assert content == (whole["reasoning_content"] or "") + whole["content"]


@pytest.mark.parametrize(
    ("body", "status", "kind", "message"),
    [
        ({"messages": []}, 400, "BadRequestError", "Messages cannot be empty."),
        ({"prompt": "a", "messages": CHATS[0]}, 400, "Bad Request", "Exactly one of"),
        ({}, 400, "Bad Request", "Exactly one of"),
        ({"messages": "hi"}, 400, "Bad Request", "Input should be a valid list"),
        ({"messages": [{"role": "bot", "content": "x"}]}, 400, "Bad Request", "'role' must be"),
        ({"messages": [{"content": "x"}]}, 400, "Bad Request", "Field required"),
        ({"messages": [{"role": "user"}]}, 400, "Bad Request", "Field required"),
        ({"messages": [{"role": "user", "content": 3}]}, 400, "Bad Request", "valid string"),
        # the template's own raise_exception: Qwen3.5 wants a user turn
        ({"messages": [{"role": "system", "content": "x"}]}, 400, "BadRequestError",
         "No user query found in messages."),
    ],
)  # fmt: skip
def test_bad_requests_get_sglangs_400s(
    clients: dict[str, httpx.Client], body: dict[str, Any], status: int, kind: str, message: str
) -> None:
    r = clients["qwen3_5"].post("/v1/tokenize", json=body)
    assert r.status_code == status
    error = r.json()
    assert set(error) == {"object", "message", "type", "param", "code"}
    assert (error["type"], error["code"]) == (kind, status) and message in error["message"]


def test_tokenize_needs_the_key_and_counts_prompts(
    engines: dict[str, Emulator], clients: dict[str, httpx.Client]
) -> None:
    url = engines["qwen3"].base_url
    assert httpx.post(f"{url}/v1/tokenize", json={"prompt": "x"}).status_code == 401
    body = clients["qwen3"].post("/v1/tokenize", json={"prompt": ["Hello there", "<think>"]})
    assert body.json() == {
        "tokens": [body.json()["tokens"][0], [THINK]],
        "count": [len(body.json()["tokens"][0]), 1],
        "max_model_len": 32768,
    }
    eos = clients["deepseek_v3_1"].post("/v1/tokenize", json={"prompt": "<｜end▁of▁sentence｜>"})
    assert eos.json()["tokens"] == [EOS_IDS["deepseek_v3_1"]]
    texts = clients["qwen3"].post("/v1/detokenize", json={"tokens": [[IM_START, THINK], []]})
    assert texts.json() == {"text": ["<think>", ""]}  # <|im_start|> is special, <think> not


def drawn_before_death(emu: Emulator, prompt: list[int], max_new: int) -> list[int]:
    """Stream /generate until the engine dies under it; the output ids received by then."""
    body = {"input_ids": prompt, "stream": True, "sampling_params": {"max_new_tokens": max_new}}
    ids: list[int] = []
    with pytest.raises(httpx.TransportError):
        with httpx.stream("POST", f"{emu.base_url}/generate", json=body, timeout=10) as r:
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    ids = json.loads(line[6:])["output_ids"]
    return ids


@pytest.mark.fault
def test_crash_after_tokens_once_then_the_restarted_engine_continues(
    start_emulator: StartEmulator, tmp_path: Path
) -> None:
    once = tmp_path / "crashed-once"
    flags = ("--emulator-crash-after-tokens", "12", "--emulator-crash-once", str(once))
    emu = start_emulator(*flags)
    with httpx.Client(base_url=emu.base_url, timeout=10) as client:
        prompt = tokenize(client, CHATS[0])
    drawn = drawn_before_death(emu, prompt, 200)
    assert emu.proc.wait(timeout=10) != 0 and once.exists()
    assert len(drawn) >= 12
    assert "RuntimeError: emulated crash after" in emu.log().strip().splitlines()[-2]
    again = start_emulator(*flags)  # the file exists: this one lives
    with httpx.Client(base_url=again.base_url, timeout=10) as client:
        whole = stream(client, prompt, 200)
        rest = stream(client, prompt + drawn, 200 - len(drawn))
    assert whole["ids"][: len(drawn)] == drawn and drawn + rest["ids"] == whole["ids"]
    assert again.proc.poll() is None


@pytest.mark.fault
def test_crash_on_prompt_fires_for_generate_by_ids(
    start_emulator: StartEmulator, tmp_path: Path
) -> None:
    """The engine dies on the prompt, and its request log names the chat that killed it."""
    log = tmp_path / "requests.jsonl"
    emu = start_emulator(
        "--emulator-crash-on-prompt", "POISON-7", env={"GENFLEET_EMULATOR_REQUEST_LOG": str(log)}
    )
    chat = [{"role": "user", "content": "Please repeat POISON-7 back to me."}]
    with httpx.Client(base_url=emu.base_url, timeout=10) as client:
        prompt = tokenize(client, chat)  # rendering is no generation: no crash
        assert client.post("/generate", json={"input_ids": prompt[:3]}).status_code == 200
        with pytest.raises(httpx.TransportError):
            client.post("/generate", json={"input_ids": prompt})
    assert emu.proc.wait(timeout=10) != 0
    assert "emulated crash on a prompt holding 'POISON-7'" in emu.log()
    last = orjson.loads(log.read_bytes().splitlines()[-1])
    assert (last["outcome"], last["body"]["messages"]) == ("crash", chat)
