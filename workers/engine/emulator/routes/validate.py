"""Request checks with SGLang's messages: JSON and content type first, then sampling ranges.

Hand-written rather than a schema library because this is the per-request hot path of the
zero-time benchmark; the messages are SGLang's (`SamplingParams.verify`, protocol.py).
"""

from __future__ import annotations

import json
import math
from typing import Any

import orjson
from aiohttp import web

from genfleet.workers.engine.emulator.routes.error_bodies import (
    BAD_REQUEST_ERROR,
    ApiError,
    validation_error,
)


async def read_json(request: web.Request, schema: str) -> dict[str, Any]:
    """The body as a JSON object, or a 400 "Bad Request" like FastAPI's remapped 422."""
    ctype = request.headers.get("Content-Type", "")
    if not ctype.startswith("application/json"):
        # FastAPI's error list, as SGLang 0.5.15 renders it (tests/golden/sglang-0.5.15).
        detail = [
            {
                "loc": ["header", "content-type"],
                "msg": "Unsupported Media Type: Only 'application/json' is allowed",
                "type": "value_error",
            }
        ]
        raise validation_error(f" {detail}")
    raw = await request.read()
    try:
        body = orjson.loads(raw)
    except orjson.JSONDecodeError:
        raise validation_error(json_invalid(raw)) from None
    if not isinstance(body, dict):
        raise validation_error(
            f"1 validation error for {schema}\nbody\n  Input should be a valid dictionary"
        )
    return body


def json_invalid(raw: bytes) -> str:
    """Starlette's JSON error as SGLang returns it: Python's json message and position (only
    on the error path, so the fast parser stays on the hot one)."""
    try:
        json.loads(raw)
    except json.JSONDecodeError as exc:
        error = {"error": exc.msg}
        position = exc.pos
    except UnicodeDecodeError as exc:
        error, position = {"error": str(exc)}, 0
    else:  # orjson refused what json takes (NaN, say): the same shape
        error, position = {"error": "Invalid JSON"}, 0
    detail = [
        {
            "type": "json_invalid",
            "loc": ("body", position),
            "msg": "JSON decode error",
            "input": {},
            "ctx": error,
        }
    ]
    return str(detail)


def field_error(schema: str, name: str, expected: str) -> ApiError:
    return validation_error(
        f"1 validation error for {schema}\n{name}\n  Input should be {expected}"
    )


def opt_int(body: dict[str, Any], name: str, schema: str) -> int | None:
    """An optional integer field; bools and floats with fractions are schema errors."""
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise field_error(schema, name, "a valid integer")
    if isinstance(value, float) and not value.is_integer():
        raise field_error(schema, name, "a valid integer")
    return int(value)


def opt_float(body: dict[str, Any], name: str, schema: str) -> float | None:
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise field_error(schema, name, "a valid number")
    return float(value)


def check_sampling(
    *,
    temperature: float | None,
    top_p: float | None,
    top_k: int | None,
    min_p: float | None,
    max_new_tokens: int | None,
) -> None:
    """SamplingParams.verify: out-of-range values are a 400 with SGLang's wording."""
    if temperature is not None and (not math.isfinite(temperature) or temperature < 0):
        raise ApiError(400, f"temperature must be a non-negative finite number, got {temperature}.")
    if top_p is not None and not 0.0 < top_p <= 1.0:
        raise ApiError(400, f"top_p must be in (0, 1], got {top_p}.", BAD_REQUEST_ERROR)
    if top_k is not None and top_k != -1 and top_k < 1:
        raise ApiError(400, f"top_k must be -1 (disable), or at least 1, got {top_k}.")
    if min_p is not None and not 0.0 <= min_p <= 1.0:
        raise ApiError(400, f"min_p must be in [0, 1], got {min_p}.")
    if max_new_tokens is not None and max_new_tokens < 0:
        raise ApiError(400, f"max_new_tokens must be at least 0, got {max_new_tokens}.")
