"""The engine client's error mapping and request shape, over real HTTP (aiohttp, the
production path) against a small local server that answers what each case needs."""

from __future__ import annotations

import asyncio
from typing import Any

import orjson
import pytest
from aiohttp import web

from genfleet.common.errors import EngineDown, EngineError, RequestRejected
from genfleet.common.records import GenerationParams, PromptRecord
from genfleet.workers.client import EngineClient, request_body
from tests.conftest import free_port

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
            EngineDown,
            "queue is full",
        ),
        (500, {"error": {"message": "boom"}}, EngineDown, "boom"),
        (401, {"error": "Unauthorized"}, EngineError, "Unauthorized"),
        (404, {"error": {"message": "not found"}}, EngineError, "not found"),
    ],
)
def test_error_mapping(status: int, body: Any, error: type[Exception], text: str) -> None:
    with pytest.raises(error, match=text) as info:
        run(_with_server([(status, body, 0.0)]))
    if error is RequestRejected:
        assert info.value.status == status  # type: ignore[attr-defined]
    if error is EngineError:
        assert not isinstance(info.value, EngineDown | RequestRejected)


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


def test_per_prompt_overrides_and_thinking_off() -> None:
    record = PromptRecord(
        "p", RECORD.messages, params={"max_tokens": 9, "temperature": 0.0, "logprobs": True}
    )
    params = GenerationParams(max_tokens=64, temperature=0.6, top_p=0.95, thinking=False)
    body = request_body(record, params, "m")
    assert body["max_tokens"] == 9 and body["temperature"] == 0.0
    assert "logprobs" not in body
    assert body["chat_template_kwargs"] == {"enable_thinking": False}
