"""The engine client's error mapping and request shape, over real HTTP (aiohttp, the
production path) against a small local server that answers what each case needs."""

from __future__ import annotations

import asyncio
from typing import Any

import orjson
import pytest
from aiohttp import web

from genfleet.common.errors import (
    EngineBusy,
    EngineConfigError,
    EngineDown,
    RequestFailed,
    RequestRejected,
)
from genfleet.common.records import GenerationParams, PromptRecord
from genfleet.workers.client import (
    EngineClient,
    ThinkingSwitch,
    answer_error,
    parse_chat,
    request_body,
    retry_after_s,
)
from tests.support import free_port

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


class Server:
    """Answers each POST with the next (status, body, delay) it was given; records bodies."""

    def __init__(self) -> None:
        self.replies: list[tuple[int, Any, float]] = []
        self.bodies: list[dict[str, Any]] = []
        self.headers: list[dict[str, str]] = []

    async def handle(self, request: web.Request) -> web.Response:
        self.bodies.append(orjson.loads(await request.read()))
        self.headers.append(dict(request.headers))
        status, body, delay = self.replies.pop(0)
        await asyncio.sleep(delay)
        return web.Response(status=status, body=orjson.dumps(body))


def run(coro: Any) -> Any:
    return asyncio.run(coro)


async def _with_server(replies: list[tuple[int, Any, float]], timeout_s: float = 5.0) -> Any:
    state = Server()
    state.replies = replies
    app = web.Application()
    app.router.add_post("/v1/chat/completions", state.handle)
    runner = web.AppRunner(app)
    await runner.setup()
    port = free_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    client = EngineClient(f"http://127.0.0.1:{port}", model="m", api_key="k", timeout_s=timeout_s)
    try:
        return await client.chat(RECORD, PARAMS), state
    finally:
        await client.aclose()
        await runner.cleanup()


def test_success_is_parsed_and_the_request_is_plain_openai() -> None:
    result, state = run(_with_server([(200, OK, 0.0)]))
    assert (result.content, result.reasoning, result.finish_reason) == ("4", "2+2", "stop")
    assert (result.usage.completion_tokens, result.usage.reasoning_tokens) == (7, 3)
    assert result.request_id == OK["id"]
    assert state.bodies == [
        {
            "model": "m",
            "messages": RECORD.messages,
            "max_tokens": 64,
            "temperature": 0.6,
            "top_p": 0.95,
        }
    ]
    assert state.headers[0]["Authorization"] == "Bearer k"


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
def test_error_mapping(status: int, body: Any, error: type[Exception], text: str) -> None:
    with pytest.raises(error, match=text) as info:
        run(_with_server([(status, body, 0.0)]))
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


def test_an_aborted_answer_is_a_failed_try_never_a_result() -> None:
    aborted = {**OK, "choices": [{**OK["choices"][0], "finish_reason": "abort"}]}  # type: ignore[dict-item]
    with pytest.raises(RequestFailed, match="aborted") as info:
        run(_with_server([(200, aborted, 0.0)]))
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
    with pytest.raises(EngineDown, match="timed out"):
        run(_with_server([(200, OK, 3.0)], timeout_s=0.5))


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
