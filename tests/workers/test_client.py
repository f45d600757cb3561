"""The engine client's answer mapping and request shape. The contract cases run over both
wires: real HTTP (aiohttp's transport, the production path, against a small local server)
and in process (`tests/fakes/transport.py`), so the fake transport answers as the real one."""

from __future__ import annotations

import asyncio
import contextlib
import functools
from collections.abc import AsyncIterator, Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import orjson
import pytest
from aiohttp import web

from genfleet.common.errors import (
    AnswerInterrupted,
    EngineBusy,
    EngineConfigError,
    EngineDown,
    RequestFailed,
    RequestRejected,
    RequestTimedOut,
)
from genfleet.common.records import GenerationParams, PromptRecord
from genfleet.common.settings import Settings
from genfleet.workers.feeding.client import (
    STREAM_CHUNK_TOKENS,
    ChatResult,
    EngineClient,
    ThinkingSwitch,
    answer_error,
    parse_chat,
    request_body,
    retry_after_s,
)
from genfleet.workers.feeding.drawn import Drawn
from genfleet.workers.feeding.native import NativeClient
from genfleet.workers.feeding.stream import ChatStream
from harness.env import free_port
from tests.fakes.transport import CUT, Answer, Cut, Events, ScriptedTransport, Whole, encoded

PARAMS = GenerationParams(max_tokens=64, temperature=0.6, top_p=0.95, thinking=True)
RECORD = PromptRecord("p1", [{"role": "user", "content": "hi"}])
OK = {
    "id": "0123456789abcdef0123456789abcdef",
    "model": "m",
    "choices": [
        {
            "index": 0,
            "message": {"role": "assistant", "content": "4", "reasoning_content": "2+2"},
            "finish_reason": "stop",
        }
    ],
    "usage": {
        "prompt_tokens": 5,
        "completion_tokens": 7,
        "total_tokens": 12,
        "reasoning_tokens": 3,
    },
}


class HttpEngine:
    """Serves scripted answers over real HTTP as `ScriptedTransport` gives them in process:
    each POST takes the next; records bodies, headers and whether a stream's client went away
    before its end. `delay_s`: how long it waits before each answer."""

    def __init__(self, answers: list[Answer], delay_s: float = 0.0, hold_s: float = 0.0) -> None:
        self.answers = answers
        self.delay_s = delay_s
        self.hold_s = hold_s  # a stream's body held open this long after its last event
        self.bodies: list[dict[str, Any]] = []
        self.headers: list[dict[str, str]] = []
        self.closed_early: list[bool] = []
        self.peers: list[Any] = []  # the client's end of each request's connection

    async def handle(self, request: web.Request) -> web.StreamResponse:
        self.bodies.append(orjson.loads(await request.read()))
        self.headers.append(dict(request.headers))
        assert request.transport is not None
        self.peers.append(request.transport.get_extra_info("peername"))
        answer = self.answers.pop(0)
        await asyncio.sleep(self.delay_s)
        if isinstance(answer, Whole):
            headers = {"Retry-After": answer.retry_after} if answer.retry_after else None
            return web.Response(status=answer.status, body=encoded(answer.body), headers=headers)
        assert isinstance(answer, Events), "an HTTP server answers; it raises nothing"
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        try:
            for event in answer.events:
                if isinstance(event, Cut):  # the engine dies: its connection is reset
                    assert request.transport is not None
                    request.transport.abort()
                    self.closed_early.append(True)
                    return response
                await response.write(b"data: " + encoded(event) + b"\n\n")
                await asyncio.sleep(0)
            await asyncio.sleep(self.hold_s)
        except (ConnectionResetError, RuntimeError):
            self.closed_early.append(True)  # the client closed the stream
            return response
        self.closed_early.append(False)
        return response


WIRES = ["http", "in-process"]
GUARDED = [*WIRES, "native"]  # the guard's cases: the chat stream, and ids from /generate


@contextlib.asynccontextmanager
async def serving(engine: HttpEngine) -> AsyncIterator[str]:
    """`engine` on a loopback port for the block; yields its base URL."""
    app = web.Application()
    app.router.add_post("/v1/chat/completions", engine.handle)
    runner = web.AppRunner(app)
    await runner.setup()
    port = free_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        await runner.cleanup()


@dataclass
class Answered:
    """What a client call returned, and what the engine saw of it."""

    result: ChatResult
    bodies: list[dict[str, Any]]
    closed_early: list[bool]
    headers: list[dict[str, str]]


def run(coro: Any) -> Any:
    return asyncio.run(coro)


def ask(
    wire: str,
    answers: list[Answer],
    record: PromptRecord = RECORD,
    delay_s: float = 0.0,
    on_begun: Callable[[], None] | None = None,
    on_tokens: Callable[[int], None] | None = None,
    params: GenerationParams = PARAMS,
    **client_args: Any,
) -> Answered:
    """One `chat` of `record` by a client whose engine answers `answers`, over `wire`
    (`GUARDED`: "native" draws the same answer by ids from `/generate`)."""
    client_args.setdefault("timeout_s", 10.0)
    if wire == "native":
        return ask_native(answers, record, params, **client_args)
    if wire == "in-process":
        transport = ScriptedTransport(answers)
        client = EngineClient("http://unused", model="m", transport=transport, **client_args)

        async def local() -> ChatResult:
            try:
                return await client.chat(record, params, None, on_begun, on_tokens)
            finally:
                await client.aclose()

        result = run(local())
        assert transport.closed
        return Answered(result, transport.bodies, transport.closed_early, [])
    streams = sum(isinstance(answer, Events) for answer in answers)
    engine = HttpEngine(answers, delay_s)

    async def served() -> ChatResult:
        async with serving(engine) as url:
            client = EngineClient(url, model="m", api_key="k", **client_args)
            try:
                result = await client.chat(record, params, None, on_begun, on_tokens)
                for _ in range(500):  # a stream's handler ends once it sees the client go
                    if len(engine.closed_early) >= streams:
                        break
                    await asyncio.sleep(0.01)
                return result
            finally:
                await client.aclose()

    result = run(served())
    return Answered(result, engine.bodies, engine.closed_early, engine.headers)


def as_generate(events: Iterable[Any]) -> Iterator[Any]:
    """A chat stream's chunks as SGLang's `/generate` streams the same answer (reasoning
    only, as the model writes it inside its thinking): each chunk's text, an id a 4
    characters, the finish in its meta_info."""
    drawn = 0
    for event in events:
        if not isinstance(event, dict):
            yield event  # [DONE]
            continue
        if not event["choices"]:
            continue  # the usage chunk: /generate's meta_info carries it
        choice = event["choices"][0]
        text = (choice["delta"] or {}).get("reasoning_content") or ""
        drawn += len(text) // 4
        finish = choice.get("finish_reason")
        meta = {"id": "r1", "completion_tokens": drawn, "finish_reason": None}
        if finish:
            meta["finish_reason"] = {"type": finish}
        yield {"text": text, "output_ids": [7] * (len(text) // 4), "meta_info": meta}


def ask_native(
    answers: list[Answer], record: PromptRecord, params: GenerationParams, **client_args: Any
) -> Answered:
    """`ask` of a client drawing by ids, its `/generate` streaming `answers` (chat streams)."""
    chat = EngineClient("http://unused", model="m", **client_args)
    tokenize = ScriptedTransport([Whole(200, {"tokens": [1, 2]}), Whole(200, {"tokens": [99]})])
    generate = ScriptedTransport(
        [Events(as_generate(a.events)) if isinstance(a, Events) else a for a in answers]
    )
    client = NativeClient(
        "http://unused",
        chat,
        reasoning_parser="qwen3",
        sampling_defaults={},
        transports=(tokenize, generate, ScriptedTransport([])),
    )
    drawn = client.drawing(record, params)
    assert isinstance(drawn, Drawn)

    async def local() -> ChatResult:
        try:
            return await client.chat(record, params, drawn=drawn)
        finally:
            await client.aclose()

    result = run(local())
    return Answered(result, generate.bodies, generate.closed_early, [])


@pytest.mark.parametrize("wire", WIRES)
def test_success_is_parsed_and_the_request_is_plain_openai(wire: str) -> None:
    answered = ask(wire, [Whole(200, OK)])
    result = answered.result
    assert (result.content, result.reasoning, result.finish_reason) == ("4", "2+2", "stop")
    assert (result.usage.completion_tokens, result.usage.reasoning_tokens) == (7, 3)
    assert result.request_id == OK["id"]
    assert answered.bodies == [
        {
            "model": "m",
            "messages": RECORD.messages,
            "max_tokens": 64,
            "temperature": 0.6,
            "top_p": 0.95,
            "stream": True,
            "stream_options": {"include_usage": True, "continuous_usage_stats": True},
        }
    ]
    if wire == "http":
        assert answered.headers[0]["Authorization"] == "Bearer k"


@pytest.mark.parametrize(
    ("status", "body", "error", "text"),
    [
        (
            400,
            {
                "object": "error",
                "message": "The input (9 tokens) is longer",
                "type": "BadRequestError",
                "code": 400,
            },
            RequestRejected,
            "longer",
        ),
        (422, {"detail": [{"msg": "extra fields not permitted"}]}, RequestRejected, "extra"),
        (
            503,
            {"object": "error", "message": "The request queue is full.", "type": "503"},
            EngineBusy,
            "queue is full",
        ),
        (429, {"error": {"message": "Rate limit reached"}}, EngineBusy, "Rate limit"),
        (500, {"error": {"message": "boom"}}, RequestFailed, "boom"),
        (502, {"error": {"message": "bad gateway"}}, RequestFailed, "bad gateway"),
        (408, {"error": {"message": "timeout"}}, RequestFailed, "timeout"),
        (401, {"error": "Unauthorized"}, EngineConfigError, "Unauthorized"),
        (403, {"error": "Forbidden"}, EngineConfigError, "Forbidden"),
        (404, {"error": {"message": "not found"}}, EngineConfigError, "not found"),
    ],
)
@pytest.mark.parametrize("wire", WIRES)
def test_error_mapping(
    wire: str, status: int, body: Any, error: type[Exception], text: str
) -> None:
    with pytest.raises(error, match=text) as info:
        ask(wire, [Whole(status, body)])
    if error is RequestRejected:
        assert info.value.status == status  # type: ignore[attr-defined]
    if error is EngineBusy:
        assert not isinstance(info.value, EngineDown)


@pytest.mark.parametrize(
    ("header", "seconds"),
    [("2", 2.0), ("0.5", 0.5), ("600", 60.0), ("-3", 0.0), ("soon", None), (None, None)],
)
def test_retry_after_is_read_and_clamped(header: str | None, seconds: float | None) -> None:
    assert retry_after_s(header) == seconds
    error = answer_error(429, b'{"error": {"message": "slow down"}}', header)
    assert isinstance(error, EngineBusy) and error.retry_after_s == seconds


def test_retry_after_as_an_http_date() -> None:
    assert retry_after_s("Thu, 01 Jan 1970 00:00:10 GMT", now=4.0) == 6.0


@pytest.mark.parametrize("wire", WIRES)
def test_an_aborted_answer_is_a_failed_try_never_a_result(wire: str) -> None:
    aborted = {**OK, "choices": [{**OK["choices"][0], "finish_reason": "abort"}]}  # type: ignore[dict-item]
    with pytest.raises(RequestFailed, match="aborted") as info:
        ask(wire, [Whole(200, aborted)])
    assert info.value.kind == "abort"


@pytest.mark.parametrize(
    "body", [{"id": "x"}, {"choices": []}, {"choices": [None]}, [1, 2]], ids=str
)
def test_a_200_that_is_not_a_completion_is_a_failed_try(body: Any) -> None:
    with pytest.raises(RequestFailed, match="not a chat completion"):
        parse_chat(body, 0.1)


@pytest.mark.parametrize(
    ("usage", "reasoning"),
    [
        ({"completion_tokens": 9, "reasoning_tokens": 4}, 4),  # SGLang
        ({"completion_tokens": 9, "completion_tokens_details": {"reasoning_tokens": 5}}, 5),
        (
            {
                "completion_tokens": 9,
                "reasoning_tokens": 0,
                "completion_tokens_details": {"reasoning_tokens": 6},
            },
            6,
        ),  # SGLang 0.5.23 fills both; a 0 at top level is not the last word
        ({"completion_tokens": 9, "completion_tokens_details": None}, 0),
        ({"completion_tokens": 9}, 0),
    ],
)
def test_reasoning_tokens_are_read_from_either_place(usage: dict[str, Any], reasoning: int) -> None:
    result = parse_chat({**OK, "usage": usage}, 0.1)
    assert result.usage.reasoning_tokens == reasoning
    assert result.usage.completion_tokens == 9


def test_deadline_is_enforced_by_the_client() -> None:
    with pytest.raises(RequestTimedOut, match="timed out"):
        ask("http", [Whole(200, OK)], delay_s=3.0, timeout_s=0.5)


def test_the_busy_answer_keeps_its_retry_after_on_either_wire() -> None:
    for wire in WIRES:
        with pytest.raises(EngineBusy) as info:
            ask(wire, [Whole(429, {"error": {"message": "slow down"}}, retry_after="3")])
        assert info.value.retry_after_s == 3.0, wire


def finished_stream(n: int) -> Events:
    return Events(
        [
            chunk({"content": f"answer {n}"}),
            chunk({}, "stop"),
            chunk(choices=[], usage={}),
            b"[DONE]",
        ]
    )


@pytest.mark.parametrize(("hold_s", "connections"), [(0.0, 1), (3.0, 4)])
def test_finished_streams_reuse_one_connection(hold_s: float, connections: int) -> None:
    """After [DONE] the end of the body is read, so the next request reuses the connection;
    a server that holds a finished body open is left after a moment (the answer is whole)."""
    engine = HttpEngine([finished_stream(n) for n in range(4)], hold_s=hold_s)

    async def go() -> list[str]:
        async with serving(engine) as url:
            client = EngineClient(url, model="m", timeout_s=10)
            try:
                return [(await client.chat(RECORD, PARAMS)).content for _ in range(4)]
            finally:
                await client.aclose()

    started = asyncio.run(asyncio.wait_for(go(), 20))
    assert started == [f"answer {n}" for n in range(4)]
    assert len(set(engine.peers)) == connections


def test_connection_refused_is_engine_down() -> None:
    async def go() -> None:
        client = EngineClient(f"http://127.0.0.1:{free_port()}", timeout_s=5)
        try:
            await client.chat(RECORD, PARAMS)
        finally:
            await client.aclose()

    with pytest.raises(EngineDown, match="unreachable"):
        run(go())


def test_per_prompt_fields_pass_as_given_and_thinking_off() -> None:
    own = {
        "max_tokens": 9,
        "temperature": 0.0,
        "logprobs": True,
        "top_logprobs": 3,
        "response_format": {"type": "json_object"},
        "chat_template_kwargs": {"custom": 1},
    }
    record = PromptRecord("p", RECORD.messages, params=own)
    params = GenerationParams(max_tokens=64, temperature=0.6, top_p=0.95, thinking=False)
    body = request_body(record, params, "m")
    assert body["max_tokens"] == 9 and body["temperature"] == 0.0 and body["top_p"] == 0.95
    assert (body["logprobs"], body["top_logprobs"]) == (True, 3)
    assert body["response_format"] == {"type": "json_object"}
    assert body["chat_template_kwargs"] == {"enable_thinking": False, "custom": 1}


def test_run_level_fields_are_sent_only_when_set() -> None:
    schema = {"type": "json_schema", "json_schema": {"name": "a", "schema": {"type": "object"}}}
    params = GenerationParams(
        max_tokens=64,
        temperature=0.6,
        top_p=0.95,
        thinking=True,
        top_k=20,
        min_p=0.05,
        repetition_penalty=1.1,
        response_format=schema,
        chat_template_kwargs={"enable_thinking": False},
    )
    body = request_body(RECORD, params, "m")
    assert (body["top_k"], body["min_p"], body["repetition_penalty"]) == (20, 0.05, 1.1)
    assert body["response_format"] == schema
    # the run's own kwargs win over the thinking switch
    assert body["chat_template_kwargs"] == {"enable_thinking": False}
    assert "top_k" not in request_body(RECORD, PARAMS, "m")


@pytest.mark.parametrize(
    ("switch", "thinking", "kwargs"),
    [
        (ThinkingSwitch("enable_thinking", True), True, None),  # Qwen3: on by default
        (ThinkingSwitch("enable_thinking", True), False, {"enable_thinking": False}),
        (ThinkingSwitch("thinking", False), True, {"thinking": True}),  # DeepSeek V3.1+
        (ThinkingSwitch("thinking", False), False, None),
        (ThinkingSwitch(None, True), False, None),  # R1: no switch
        (ThinkingSwitch("enable_thinking", None), True, {"enable_thinking": True}),  # by hand
    ],
)
def test_the_thinking_switch_of_each_family(
    switch: ThinkingSwitch, thinking: bool, kwargs: dict[str, Any] | None
) -> None:
    params = PARAMS.model_copy(update={"thinking": thinking})
    assert request_body(RECORD, params, "m", switch).get("chat_template_kwargs") == kwargs


def chunk(delta: dict[str, Any] | None = None, finish: str | None = None, **extra: Any) -> Any:
    """One SGLang chat stream chunk (choice 0), or with `choices=[]` the usage chunk."""
    head: dict[str, Any] = {"id": OK["id"], "object": "chat.completion.chunk", "model": "m"}
    if "choices" in extra:
        return {**head, **extra}
    choice = {"index": 0, "delta": delta or {}, "logprobs": None, "finish_reason": finish}
    return {**head, "choices": [choice], **extra}


@pytest.mark.parametrize("wire", WIRES)
def test_a_stream_is_assembled_like_a_whole_answer(wire: str) -> None:
    usage = {"prompt_tokens": 5, "completion_tokens": 7, "total_tokens": 12, "reasoning_tokens": 3}
    logprob = {"token": "4", "bytes": [52], "logprob": -0.1, "top_logprobs": []}
    lines = [
        chunk({"role": "assistant", "content": "", "reasoning_content": None}),
        chunk({"reasoning_content": "2+"}),
        chunk({"reasoning_content": "2"}),
        chunk({"reasoning_content": None, "content": "4"}, logprobs=None),
        {**chunk({"content": "."}), "choices": [{"index": 0, "delta": {"content": "!"},
                                                  "logprobs": {"content": [logprob]}}]},
        chunk({"reasoning_content": None}, "stop"),
        chunk(choices=[], usage=usage),
        b"[DONE]",
    ]  # fmt: skip
    answered = ask(wire, [Events(lines)])
    result = answered.result
    assert (result.reasoning, result.content, result.finish_reason) == ("2+2", "4!", "stop")
    assert (result.usage.prompt_tokens, result.usage.completion_tokens) == (5, 7)
    assert result.usage.reasoning_tokens == 3
    assert (result.request_id, result.model) == (OK["id"], "m")
    assert result.logprobs == {"content": [logprob]}
    assert result.repetition is None
    assert answered.bodies[0]["stream"] is True
    assert answered.bodies[0]["stream_options"]["include_usage"] is True
    assert answered.closed_early == [False]


@pytest.mark.parametrize(
    ("error", "raised"),
    [
        ({"message": "Input length (9 tokens) exceeds", "type": "BAD_REQUEST", "code": 400},
         RequestRejected),
        ({"message": "The request queue is full.", "type": "SERVICE_UNAVAILABLE", "code": 503},
         EngineBusy),
        ({"message": "scheduler died", "type": "INTERNAL", "code": 500}, RequestFailed),
        ({"message": "no code"}, RequestFailed),
    ],
)  # fmt: skip
@pytest.mark.parametrize("wire", WIRES)
def test_an_in_stream_error_maps_like_its_status(
    wire: str, error: dict[str, Any], raised: type
) -> None:
    lines = [chunk({"role": "assistant", "content": ""}), {"error": error}, b"[DONE]"]
    with pytest.raises(raised, match=error["message"][:12]):
        ask(wire, [Events(lines)])


@pytest.mark.parametrize("wire", WIRES)
def test_a_stream_that_does_not_finish_is_a_failed_try(wire: str) -> None:
    cases = [
        ([chunk({"content": "half an ans"})], "bad_response"),  # cut before the finish chunk
        ([chunk({"content": "partial"}), chunk({}, "abort"), b"[DONE]"], "abort"),
        ([b"{not json"], "bad_response"),
    ]
    for lines, kind in cases:
        with pytest.raises(RequestFailed) as info:
            ask(wire, [Events(lines)])
        assert info.value.kind == kind


@pytest.mark.parametrize("wire", WIRES)
def test_an_engine_that_dies_mid_answer_says_whether_the_answer_had_begun(wire: str) -> None:
    """A connection broken after output text arrived is AnswerInterrupted (the prompt was past
    its arrival, not the cause of the death); broken before any text (the role chunk alone
    is no output on every engine) it is a plain EngineDown."""
    role = chunk({"role": "assistant", "content": ""})
    with pytest.raises(AnswerInterrupted):
        ask(wire, [Events([role, chunk({"reasoning_content": "Let me think"}), CUT])])
    with pytest.raises(EngineDown) as info:
        ask(wire, [Events([role, CUT])])
    assert not isinstance(info.value, AnswerInterrupted)


@pytest.mark.parametrize("wire", WIRES)
def test_on_begun_fires_once_at_the_first_output_text(wire: str) -> None:
    """The feeder's arrival ends at the answer's first text, reasoning or content, once; the
    role chunk (an empty content on every engine) is no output, nor is a cut before text."""
    role = chunk({"role": "assistant", "content": "", "reasoning_content": None})
    usage = {"prompt_tokens": 5, "completion_tokens": 3, "total_tokens": 8}
    whole = [
        role,
        chunk({"reasoning_content": "2+2"}),
        chunk({"content": "4"}),
        chunk({}, finish="stop"),
        chunk(choices=[], usage=usage),
        b"[DONE]",
    ]
    cases: list[tuple[list[Any], int]] = [
        (whole, 1),
        ([role, chunk({"content": "4"}), CUT], 1),
        ([role, CUT], 0),
    ]
    for events, begun in cases:
        calls: list[int] = []
        try:
            ask(wire, [Events(events)], on_begun=functools.partial(calls.append, 1))
        except EngineDown:
            assert events[-1] is CUT
        assert len(calls) == begun, events


def looping(prefix: str, block: str, max_chunks: int, tokens_per_chunk: int = 32) -> Any:
    """A stream that answers `prefix`, then `block` forever (or `max_chunks` chunks and a
    length finish), 4 characters a token, with continuous usage."""
    text = prefix + block * (max_chunks * tokens_per_chunk * 4 // len(block) + 1)
    size = tokens_per_chunk * 4
    yield chunk({"role": "assistant", "content": ""})
    for i in range(max_chunks):
        used = {"prompt_tokens": 5, "completion_tokens": (i + 1) * tokens_per_chunk}
        yield chunk({"reasoning_content": text[i * size : (i + 1) * size]}, usage=used)
    yield chunk({}, "length")
    yield chunk(choices=[], usage={"completion_tokens": max_chunks * tokens_per_chunk})
    yield b"[DONE]"


@pytest.mark.parametrize("wire", GUARDED)
def test_a_looping_stream_is_stopped_at_once_and_kept_as_repetition(wire: str) -> None:
    prefix = "Let me think about the sum of the first odd numbers. " * 3
    block = "Wait, let me recount the odd numbers once more from the start. "
    params_tokens = PARAMS.max_tokens * 1000  # a budget far above what the loop spends
    record = PromptRecord("p1", RECORD.messages, params={"max_tokens": params_tokens})

    answered = ask(wire, [Events(looping(prefix, block, max_chunks=10_000))], record)
    assert answered.closed_early == [True]  # the engine saw its client go: SGLang aborts
    result = answered.result
    loop = result.repetition
    assert result.finish_reason == "repetition"
    assert loop["field"] == "reasoning" and loop["block_chars"] == len(block)
    assert abs(loop["start_char"] - len(prefix)) < len(block)
    assert len(result.reasoning) < len(prefix) + 3000 + 2 * 256 + 2 * 128  # stopped at once
    assert result.usage.completion_tokens == loop["completion_tokens"]
    assert result.usage.completion_tokens == len(result.reasoning) // 4  # the engine's count
    assert loop["tokens_saved"] == params_tokens - result.usage.completion_tokens
    assert abs(loop["start_token_estimate"] - len(prefix) // 4) <= len(block)
    assert loop["rule"] == "block" and loop["block"] in block + block  # the evidence
    assert loop["repeats"] * len(block) >= 3000


@pytest.mark.parametrize("wire", GUARDED)
@pytest.mark.parametrize(
    ("prompt", "stopped"),
    [
        ("Explain how to count odd numbers.", True),
        ("Write this line 100 times: Wait, let me recount the odd numbers once more.", False),
        ("Copy out: 'Wait, let me recount the odd numbers once more from the start.'", False),
    ],
)
def test_the_guard_reads_the_prompt(wire: str, prompt: str, stopped: bool) -> None:
    """The chat's prompt reaches the guard: repetition it asks for or holds is never stopped."""
    block = "Wait, let me recount the odd numbers once more from the start.\n"
    record = PromptRecord("p1", [{"role": "user", "content": prompt}])
    answered = ask(wire, [Events(looping("", block, max_chunks=60))], record)  # 120 copies
    assert (answered.result.finish_reason == "repetition") is stopped
    assert answered.closed_early == [stopped]


@pytest.mark.parametrize("wire", GUARDED)
def test_with_the_guard_off_a_loop_runs_to_its_end(wire: str) -> None:
    block = "Wait, let me recount the odd numbers once more from the start. "
    answered = ask(wire, [Events(looping("", block, max_chunks=60))], repetition=None)
    result = answered.result
    assert result.finish_reason == "length"
    assert result.usage.completion_tokens == 60 * 32
    assert answered.closed_early == [False]


@pytest.mark.parametrize("wire", GUARDED)
def test_an_order_with_the_guard_off_lets_a_loop_run_and_sends_no_such_field(wire: str) -> None:
    """`retry --stopped --no-repetition-guard`: its orders switch the worker's guard off for
    their answers alone; the engine never sees the field."""
    block = "Wait, let me recount the odd numbers once more from the start. "
    off = PARAMS.model_copy(update={"repetition_guard": False})
    answered = ask(wire, [Events(looping("", block, max_chunks=60))], params=off)
    assert answered.result.finish_reason == "length" and answered.result.repetition is None
    assert answered.closed_early == [False]
    assert all("repetition_guard" not in body for body in answered.bodies)
    watched = ask(wire, [Events(looping("", block, max_chunks=60))])  # the same client's guard
    assert watched.result.finish_reason == "repetition"


GOLDEN_STREAM = Path(__file__).resolve().parents[1] / "golden" / "sglang-0.5.15" / "chat_stream.sse"


@pytest.mark.parametrize("wire", WIRES)
def test_a_stream_recorded_from_real_sglang_is_assembled(wire: str) -> None:
    """SGLang 0.5.15's own chat stream (tests/golden), served back: the client puts together
    the same reasoning, finish reason and usage the stream carries."""
    payloads = [
        line[len(b"data: ") :]
        for line in GOLDEN_STREAM.read_bytes().splitlines()
        if line.startswith(b"data: ")
    ]
    chunks = [orjson.loads(p) for p in payloads if p != b"[DONE]"]
    deltas = [c["choices"][0]["delta"] for c in chunks if c["choices"]]
    usage = chunks[-1]["usage"]
    result = ask(wire, [Events(payloads)]).result
    assert result.reasoning == "".join(d.get("reasoning_content") or "" for d in deltas)
    assert result.content == "".join(d.get("content") or "" for d in deltas)
    assert result.finish_reason == "length" and result.repetition is None
    assert (result.usage.completion_tokens, result.usage.reasoning_tokens) == (
        usage["completion_tokens"],
        usage["reasoning_tokens"],
    )
    assert result.request_id == chunks[0]["id"]


def used(tokens: int) -> dict[str, int]:
    """A chunk's usage so far (`stream_options.continuous_usage_stats`)."""
    return {"prompt_tokens": 5, "completion_tokens": tokens}


ROLE = chunk({"role": "assistant", "content": "", "reasoning_content": None})
# name, chunks, tokens a chunk without usage counts → (each count change, streamed in all)
STREAM_COUNTS: list[tuple[str, list[Any], int, tuple[list[int], int]]] = [
    ("usage on every chunk: its count, exact",
     [ROLE, chunk({"reasoning_content": "ab"}, usage=used(3)),
      chunk({"content": "cd"}, usage=used(7)), chunk({}, "stop"),
      chunk(choices=[], usage=used(7))], 4, ([3, 4], 7)),
    ("no usage until the end: chunk size, then set right",
     [ROLE, chunk({"reasoning_content": "ab"}), chunk({"content": "cd"}),
      chunk({"content": "e"}), chunk({}, "stop"), chunk(choices=[], usage=used(10))], 4,
     ([4, 4, 4, -2], 10)),
    ("an estimate short of the count is raised", [chunk({"content": "ab"}),
     chunk(choices=[], usage=used(9))], 4, ([4, 5], 9)),
    ("the role chunk and the finish chunk count nothing", [ROLE, chunk({}, "stop")], 4,
     ([], 0)),
    ("a stream cut before its usage keeps its estimate",
     [ROLE, chunk({"content": "ab"}), chunk({"content": "cd"})], 32, ([32, 32], 64)),
    ("an error chunk counts nothing", [chunk({"content": "ab"}, usage=used(2)),
     {"error": {"message": "x", "code": 500}}], 4, ([2], 2)),
]  # fmt: skip


@pytest.mark.parametrize(
    ("chunks", "chunk_tokens", "expected"),
    [c[1:] for c in STREAM_COUNTS],
    ids=[c[0] for c in STREAM_COUNTS],
)
def test_tokens_are_counted_as_they_stream(
    chunks: list[Any], chunk_tokens: int, expected: tuple[list[int], int]
) -> None:
    changes: list[int] = []
    stream = ChatStream(None, on_tokens=changes.append, chunk_tokens=chunk_tokens)
    for event in chunks:
        stream.feed(b"data: " + encoded(event))
    assert (changes, stream.streamed_tokens) == expected


@pytest.mark.parametrize("wire", WIRES)
def test_the_client_reports_streamed_tokens_and_their_correction(wire: str) -> None:
    """Over either wire, a chunk without usage counts the engine's stream interval; the usage
    chunk sets the count right, so the changes add up to the answer's exact count."""
    lines = [ROLE, chunk({"content": "ab"}), chunk({"content": "cd"}), chunk({}, "stop"),
             chunk(choices=[], usage=used(13)), b"[DONE]"]  # fmt: skip
    changes: list[int] = []
    result = ask(wire, [Events(lines)], on_tokens=changes.append, stream_chunk_tokens=8).result
    assert changes == [8, 8, -3]
    assert sum(changes) == result.usage.completion_tokens == 13


@pytest.mark.parametrize("wire", WIRES)
def test_a_real_sglang_stream_counts_to_its_usage(wire: str) -> None:
    """SGLang 0.5.15's recorded stream (`--stream-interval 1`, no usage per chunk): one token
    a chunk while it streams, set right to its usage at the end."""
    payloads = [
        line[len(b"data: ") :]
        for line in GOLDEN_STREAM.read_bytes().splitlines()
        if line.startswith(b"data: ")
    ]
    changes: list[int] = []
    result = ask(wire, [Events(payloads)], on_tokens=changes.append, stream_chunk_tokens=1).result
    assert sum(changes) == result.usage.completion_tokens == 48
    assert all(n == 1 for n in changes[:-1])


def test_the_client_s_chunk_size_is_the_engine_s_default_stream_interval() -> None:
    assert STREAM_CHUNK_TOKENS == Settings().stream_chunk_tokens
