"""The engine client: one chat completion per prompt over a reused HTTP connection pool.

Errors are mapped here, at the seam:
- 400 (prompt too long, bad parameters) → RequestRejected: permanent for that prompt; it
  becomes an error record and the batch goes on.
- connection refused/reset, 5xx, 503 (queue full) → EngineDown: retried by the feeder after
  the supervisor has the engine up again.
- 401/403/404 → EngineError: a configuration problem (API key, wrong URL), not a prompt's.
The hot path decodes with orjson and builds no validation models per request.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import httpx
import orjson

from common.errors import EngineDown, EngineError, RequestRejected
from common.records import GenerationParams, PromptRecord, Usage


@dataclass(slots=True)
class ChatResult:
    content: str | None
    reasoning: str | None
    finish_reason: str | None
    usage: Usage
    latency_s: float
    request_id: str | None
    model: str | None


def request_body(
    record: PromptRecord, params: GenerationParams, model: str, reasoning: bool
) -> dict[str, Any]:
    """The /v1/chat/completions body: run parameters, overridden by the prompt's own."""
    body: dict[str, Any] = {
        "model": model,
        "messages": record.messages,
        "max_tokens": params.max_tokens,
        "temperature": params.temperature,
        "top_p": params.top_p,
    }
    if record.params:
        for name, value in record.params.items():
            if name in {"max_tokens", "temperature", "top_p", "stop", "seed"}:
                body[name] = value
    if not params.thinking:
        body["chat_template_kwargs"] = {"enable_thinking": False}
    if reasoning:
        body["separate_reasoning"] = True
    return body


def parse_chat(data: dict[str, Any], latency_s: float) -> ChatResult:
    choice = data["choices"][0]
    message = choice.get("message") or {}
    usage = data.get("usage") or {}
    return ChatResult(
        content=message.get("content"),
        reasoning=message.get("reasoning_content"),
        finish_reason=choice.get("finish_reason"),
        usage=Usage(
            prompt_tokens=int(usage.get("prompt_tokens") or 0),
            completion_tokens=int(usage.get("completion_tokens") or 0),
            reasoning_tokens=int(usage.get("reasoning_tokens") or 0),
        ),
        latency_s=latency_s,
        request_id=data.get("id"),
        model=data.get("model"),
    )


def _error_message(payload: bytes) -> tuple[str, str]:
    try:
        data = orjson.loads(payload)
    except orjson.JSONDecodeError:
        return "error", payload[:500].decode("utf-8", "replace")
    if isinstance(data, dict):
        inner = data.get("error", data)
        if isinstance(inner, dict):
            return str(inner.get("type") or "error"), str(inner.get("message") or inner)
        return "error", str(inner)
    return "error", str(data)


class EngineClient:
    """Async client for one engine; one instance per worker, shared by every batch."""

    def __init__(
        self,
        base_url: str,
        *,
        model: str = "default",
        api_key: str | None = None,
        timeout_s: float = 3600.0,
        max_connections: int = 256,
        reasoning: bool = True,
        transport: httpx.AsyncBaseTransport | None = None,
    ) -> None:
        headers = {"Content-Type": "application/json"}
        if api_key:
            headers["Authorization"] = f"Bearer {api_key}"
        self.model = model
        self.reasoning = reasoning
        self._http = httpx.AsyncClient(
            base_url=base_url,
            headers=headers,
            timeout=httpx.Timeout(timeout_s, connect=10.0),
            limits=httpx.Limits(
                max_connections=max_connections, max_keepalive_connections=max_connections
            ),
            transport=transport,
        )

    async def chat(self, record: PromptRecord, params: GenerationParams) -> ChatResult:
        body = request_body(record, params, self.model, self.reasoning)
        started = time.monotonic()
        try:
            response = await self._http.post("/v1/chat/completions", content=orjson.dumps(body))
        except httpx.TimeoutException as exc:
            raise EngineDown(f"request timed out: {exc.__class__.__name__}") from exc
        except httpx.TransportError as exc:
            raise EngineDown(f"engine unreachable: {exc.__class__.__name__}: {exc}") from exc
        payload = response.content
        status = response.status_code
        if status == 200:
            return parse_chat(orjson.loads(payload), time.monotonic() - started)
        kind, message = _error_message(payload)
        if status == 400:
            raise RequestRejected(status, kind, message)
        if status >= 500:
            raise EngineDown(f"engine answered {status}: {message}")
        raise EngineError(f"engine answered {status}: {message}")

    async def aclose(self) -> None:
        await self._http.aclose()
