"""The engine client: one chat completion per prompt over a reused HTTP connection pool.

Errors are mapped here, at the seam:
- 400 (prompt too long, bad parameters) → RequestRejected: permanent for that prompt; it
  becomes an error record and the batch goes on.
- connection refused/reset, 5xx, 503 (queue full) → EngineDown: retried by the feeder after
  the supervisor has the engine up again.
- 401/403/404 → EngineError: a configuration problem (API key, wrong URL), not a prompt's.
The hot path decodes with orjson and builds no validation models per request. It speaks
HTTP through aiohttp: with a pool of a few hundred connections httpx managed ~400 requests/s
on one core and aiohttp ~4–5K (bench/client_overhead.py measures both). Passing an httpx
transport (a MockTransport in a test, or `httpx.AsyncHTTPTransport` to compare) selects the
httpx path instead; both map errors the same way. On the aiohttp path `timeout_s` is a
deadline for the whole request (connect, queue on the engine, generation, body); on the httpx
path it bounds each connect/read/write, as before.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Protocol

import aiohttp
import httpx
import orjson
from yarl import URL

from genfleet.common.errors import EngineDown, EngineError, RequestRejected
from genfleet.common.records import GenerationParams, PromptRecord, Usage
from genfleet.workers.engine.launch import auth_headers


@dataclass(slots=True)
class ChatResult:
    content: str | None
    reasoning: str | None
    finish_reason: str | None
    usage: Usage
    latency_s: float
    request_id: str | None
    model: str | None


def request_body(record: PromptRecord, params: GenerationParams, model: str) -> dict[str, Any]:
    """The /v1/chat/completions body: run parameters, overridden by the prompt's own.

    Only OpenAI fields plus `chat_template_kwargs` (SGLang and vLLM read it to turn thinking
    off): strict OpenAI-compatible servers refuse unknown keys. SGLang separates reasoning by
    default when it runs with a reasoning parser.
    """
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


class _Post(Protocol):
    """One HTTP POST: (status, body bytes); transport failures raise EngineDown."""

    async def __call__(self, body: bytes) -> tuple[int, bytes]: ...

    async def aclose(self) -> None: ...


class _AiohttpPost:
    """The production path: one aiohttp session, a keep-alive pool, a prebuilt URL."""

    def __init__(
        self, url: str, headers: dict[str, str], timeout_s: float, max_connections: int
    ) -> None:
        self._url = URL(url)
        self._headers = headers
        self._timeout = aiohttp.ClientTimeout(total=timeout_s, connect=10.0)
        self._max_connections = max_connections
        self._session: aiohttp.ClientSession | None = None

    def _open(self) -> aiohttp.ClientSession:
        """Made on first use, inside the loop that will run every request."""
        connector = aiohttp.TCPConnector(
            limit=self._max_connections, ttl_dns_cache=None, keepalive_timeout=60.0
        )
        self._session = aiohttp.ClientSession(
            connector=connector,
            timeout=self._timeout,
            headers=self._headers,
            auto_decompress=False,
        )
        return self._session

    async def __call__(self, body: bytes) -> tuple[int, bytes]:
        session = self._session or self._open()
        try:
            async with session.post(self._url, data=body) as response:
                return response.status, await response.read()
        except TimeoutError as exc:
            raise EngineDown(f"request timed out: {exc.__class__.__name__}") from exc
        except aiohttp.ClientError as exc:
            raise EngineDown(f"engine unreachable: {exc.__class__.__name__}: {exc}") from exc

    async def aclose(self) -> None:
        if self._session is not None:
            await self._session.close()


class _HttpxPost:
    """The httpx path, taken when a transport is given (tests, comparisons)."""

    def __init__(
        self,
        url: str,
        headers: dict[str, str],
        timeout_s: float,
        max_connections: int,
        transport: httpx.AsyncBaseTransport,
    ) -> None:
        self._url = url
        self._http = httpx.AsyncClient(
            headers=headers,
            timeout=httpx.Timeout(timeout_s, connect=10.0),
            limits=httpx.Limits(
                max_connections=max_connections, max_keepalive_connections=max_connections
            ),
            transport=transport,
        )

    async def __call__(self, body: bytes) -> tuple[int, bytes]:
        try:
            response = await self._http.post(self._url, content=body)
        except httpx.TimeoutException as exc:
            raise EngineDown(f"request timed out: {exc.__class__.__name__}") from exc
        except httpx.TransportError as exc:
            raise EngineDown(f"engine unreachable: {exc.__class__.__name__}: {exc}") from exc
        return response.status_code, response.content

    async def aclose(self) -> None:
        await self._http.aclose()


class EngineClient:
    """Async client for one engine; one instance per worker, shared by every batch.

    Examples:
        EngineClient("http://127.0.0.1:30000", model="m", timeout_s=3600)   # aiohttp
        EngineClient(url, transport=httpx.MockTransport(handler))           # httpx, a test
    """

    def __init__(
        self,
        base_url: str,
        *,
        model: str = "default",
        api_key: str | None = None,
        timeout_s: float = 3600.0,
        max_connections: int = 256,
        transport: httpx.AsyncBaseTransport | None = None,
    ) -> None:
        headers = {"Content-Type": "application/json", **auth_headers(api_key)}
        self.model = model
        self.timeout_s = timeout_s
        url = base_url.rstrip("/") + "/v1/chat/completions"
        self._post: _Post
        if transport is None:
            self._post = _AiohttpPost(url, headers, timeout_s, max_connections)
        else:
            self._post = _HttpxPost(url, headers, timeout_s, max_connections, transport)

    async def chat(self, record: PromptRecord, params: GenerationParams) -> ChatResult:
        body = orjson.dumps(request_body(record, params, self.model))
        started = time.monotonic()
        status, payload = await self._post(body)
        if status == 200:
            return parse_chat(orjson.loads(payload), time.monotonic() - started)
        kind, message = _error_message(payload)
        if status in (400, 422):  # 422: how vLLM-style servers refuse one request's fields
            raise RequestRejected(status, kind, message)
        if status >= 500:
            raise EngineDown(f"engine answered {status}: {message}")
        raise EngineError(f"engine answered {status}: {message}")

    async def aclose(self) -> None:
        await self._post.aclose()
