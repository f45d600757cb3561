"""SGLang's three error bodies (contract §4) and the one exception the handlers raise.

A: `{"object":"error","message","type","param":null,"code"}` for OpenAI-style routes.
B: `{"error":{"message"}}` for a non-streaming /generate.
C: an in-stream `data: {"error":{…}}` once a 200 stream has started.
"""

from __future__ import annotations

from typing import Any

import orjson
from aiohttp import web

BAD_REQUEST = "Bad Request"  # FastAPI validation errors, remapped from 422 to 400
BAD_REQUEST_ERROR = "BadRequestError"


class ApiError(Exception):
    """A request SGLang would refuse. `stage` says where: the tokenizer refuses before a
    stream starts (an HTTP error even when streaming); the scheduler refuses after (an
    in-stream error on a 200)."""

    def __init__(
        self,
        status: int,
        message: str,
        err_type: str = BAD_REQUEST_ERROR,
        *,
        stage: str = "tokenizer",
        stream_type: str = "BAD_REQUEST",
    ):
        super().__init__(message)
        self.status = status
        self.message = message
        self.err_type = err_type
        self.stage = stage
        self.stream_type = stream_type

    def body_a(self) -> dict[str, Any]:
        return {
            "object": "error",
            "message": self.message,
            "type": self.err_type,
            "param": None,
            "code": self.status,
        }

    def body_b(self) -> dict[str, Any]:
        return {"error": {"message": self.message}}

    def chat_stream_chunk(self) -> dict[str, Any]:
        return {
            "error": {
                "object": "error",
                "message": self.message,
                "type": self.stream_type,
                "param": None,
                "code": self.status,
            }
        }

    def generate_stream_chunk(self) -> dict[str, Any]:
        return {
            "error": {
                "message": self.message,
                "type": "invalid_request_error",
                "code": self.status,
                "retryable": self.status >= 500,
            }
        }


def validation_error(message: str) -> ApiError:
    """Malformed JSON, a schema violation or a wrong content type: 400, never 422."""
    return ApiError(400, message, BAD_REQUEST)


def queue_full() -> ApiError:
    return ApiError(
        503,
        "The request queue is full.",
        "503",
        stage="scheduler",
        stream_type="SERVICE_UNAVAILABLE",
    )


def json_response(body: Any, status: int = 200) -> web.Response:
    """orjson-encoded JSON, the one serializer on every path (it is the hot path)."""
    return web.Response(body=orjson.dumps(body), status=status, content_type="application/json")


def sse(data: Any) -> bytes:
    """One server-sent event: `data: {json}` and a blank line."""
    return b"data: " + orjson.dumps(data) + b"\n\n"


SSE_DONE = b"data: [DONE]\n\n"
