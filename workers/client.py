"""The engine client: one chat completion per prompt over a reused HTTP connection pool.

Every answer is mapped here, at the seam (`answer_error` for statuses, `parse_chat` for a 200):
- 400/413/422 (prompt too long, bad parameters) → RequestRejected: permanent for that prompt;
  it becomes an error record and the batch goes on.
- 429, 503 (SGLang's "The request queue is full.") → EngineBusy: backpressure. The feeder
  honours `Retry-After`, shrinks its in-flight limit for a while and sends the prompt again.
- 401/403/404/405 → EngineConfigError: a wrong API key, URL or model name; the worker stops
  consuming rather than spend every batch's retries.
- other 5xx and 4xx, a 200 with `finish_reason "abort"` or without a choice → RequestFailed:
  a failed try, sent again, then an error record; never stored as a completion.
- connection refused/reset, a connect timeout → EngineDown: retried after the supervisor has
  the engine up again; a request past its deadline → RequestTimedOut (that prompt's error).
The hot path decodes with orjson and builds no validation models per request. It speaks HTTP
through aiohttp (with a pool of a few hundred connections it sustains ~10x httpx's request
rate on one core); `timeout_s` is a deadline for the whole request (connect, queue on the
engine, generation, body), the client's own or the one a call passes (`workers/deadline`).
"""

from __future__ import annotations

import email.utils
import time
from dataclasses import dataclass
from typing import Any

import aiohttp
import orjson
from yarl import URL

from genfleet.common.errors import (
    EngineBusy,
    EngineConfigError,
    EngineDown,
    EngineUnreachable,
    RequestFailed,
    RequestRejected,
    RequestTimedOut,
)
from genfleet.common.records import GenerationParams, PromptRecord, Usage
from genfleet.workers.engine.launch import auth_headers

# The longest Retry-After honoured: a server asking for more is waited on in steps of this.
MAX_RETRY_AFTER_S = 60.0


@dataclass(slots=True)
class ChatResult:
    content: str | None
    reasoning: str | None
    finish_reason: str | None
    usage: Usage
    latency_s: float
    request_id: str | None
    model: str | None
    logprobs: Any = None


@dataclass(frozen=True, slots=True)
class ThinkingSwitch:
    """The chat-template switch that turns a model family's thinking on or off.

    `key` is its name in `chat_template_kwargs` (`enable_thinking` for Qwen3, `thinking` for
    DeepSeek V3.1+), `default` what the template does when it is not sent (None: unknown,
    always send it). It is sent only when a run asks for the other value, so strict OpenAI
    servers never see it otherwise.
    """

    key: str | None = "enable_thinking"
    default: bool | None = True


def request_body(
    record: PromptRecord,
    params: GenerationParams,
    model: str,
    thinking: ThinkingSwitch | None = None,
) -> dict[str, Any]:
    """The /v1/chat/completions body: run parameters, overridden by the prompt's own.

    The run's optional fields are sent only when set. A prompt's own fields (an OpenAI Batch
    body, already checked by the reader) pass as given; its `chat_template_kwargs` are merged
    over the run's and the thinking switch.
    """
    switch = thinking or ThinkingSwitch()
    body: dict[str, Any] = {
        "model": model,
        "messages": record.messages,
        "max_tokens": params.max_tokens,
        "temperature": params.temperature,
        "top_p": params.top_p,
    }
    for name in ("top_k", "min_p", "repetition_penalty", "response_format"):
        value = getattr(params, name)
        if value is not None:
            body[name] = value
    kwargs: dict[str, Any] = {}
    if switch.key and (switch.default is None or params.thinking != switch.default):
        kwargs[switch.key] = params.thinking
    kwargs.update(params.chat_template_kwargs or {})
    if record.params:
        own = dict(record.params)
        kwargs.update(own.pop("chat_template_kwargs", None) or {})
        body.update(own)
    if kwargs:
        body["chat_template_kwargs"] = kwargs
    return body


def reasoning_tokens(usage: dict[str, Any]) -> int:
    """SGLang's `usage.reasoning_tokens`, or OpenAI's `completion_tokens_details` one."""
    top = usage.get("reasoning_tokens")
    if top:
        return int(top)
    details = usage.get("completion_tokens_details")
    if isinstance(details, dict) and details.get("reasoning_tokens"):
        return int(details["reasoning_tokens"])
    return 0


def parse_chat(data: Any, latency_s: float) -> ChatResult:
    """A 200's body → ChatResult; RequestFailed when it is not a finished completion."""
    try:
        choice = data["choices"][0]
        message = choice.get("message") or {}
        usage = data.get("usage") or {}
        finish = choice.get("finish_reason")
        result = ChatResult(
            content=message.get("content"),
            reasoning=message.get("reasoning_content"),
            finish_reason=finish,
            usage=Usage(
                prompt_tokens=int(usage.get("prompt_tokens") or 0),
                completion_tokens=int(usage.get("completion_tokens") or 0),
                reasoning_tokens=reasoning_tokens(usage),
            ),
            latency_s=latency_s,
            request_id=data.get("id"),
            model=data.get("model"),
            logprobs=choice.get("logprobs"),
        )
    except (KeyError, IndexError, TypeError, AttributeError, ValueError) as exc:
        raise RequestFailed(200, "bad_response", f"not a chat completion: {exc!r}") from exc
    if finish == "abort":
        # SGLang's scheduler aborted the request; the text is partial. A failed try.
        raise RequestFailed(
            200,
            "abort",
            f"the engine aborted the request after {result.usage.completion_tokens} tokens "
            f"(finish_reason abort, request {result.request_id})",
        )
    return result


def error_message(payload: bytes) -> tuple[str, str]:
    """(type, message) of an error body in any of SGLang's or OpenAI's shapes."""
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


def retry_after_s(value: str | None, now: float | None = None) -> float | None:
    """`Retry-After` in seconds (delta-seconds or an HTTP date), clamped to [0, 60]."""
    if not value:
        return None
    text = value.strip()
    try:
        seconds = float(text)
    except ValueError:
        try:
            when = email.utils.parsedate_to_datetime(text)
        except (TypeError, ValueError):
            return None
        seconds = when.timestamp() - (time.time() if now is None else now)
    if seconds != seconds:  # NaN
        return None
    return min(max(seconds, 0.0), MAX_RETRY_AFTER_S)


def answer_error(status: int, payload: bytes, retry_after: str | None = None) -> Exception:
    """The error a non-200 answer stands for (see the module docstring for the table)."""
    kind, message = error_message(payload)
    text = f"engine answered {status}: {message}"
    if status in (400, 413, 422):  # 422: how vLLM-style servers refuse one request's fields
        return RequestRejected(status, kind, message)
    if status in (429, 503):
        return EngineBusy(text, retry_after_s(retry_after))
    if status in (401, 403, 404, 405):
        return EngineConfigError(
            f"{text} (check --engine-api-key, --engine-url and --served-model-name: every "
            "request would get the same answer)"
        )
    return RequestFailed(status, kind or "http_error", text)


class _AiohttpPost:
    """One aiohttp session, a keep-alive pool, a prebuilt URL."""

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

    async def __call__(
        self, body: bytes, timeout_s: float | None = None
    ) -> tuple[int, bytes, str | None]:
        """(status, body, Retry-After); transport failures raise EngineDown, the request's
        deadline (`timeout_s`, else the session's) RequestTimedOut."""
        session = self._session or self._open()
        timeout = self._timeout if timeout_s is None else self._deadline(timeout_s)
        try:
            async with session.post(self._url, data=body, timeout=timeout) as response:
                payload = await response.read()
                status = response.status
                # Retry-After matters only on a refusal: no header lookup per completion.
                return (
                    status,
                    payload,
                    None if status == 200 else response.headers.get("Retry-After"),
                )
        except (aiohttp.ConnectionTimeoutError, aiohttp.ClientConnectorError) as exc:
            raise EngineUnreachable(f"engine unreachable: {exc.__class__.__name__}: {exc}") from exc
        except TimeoutError as exc:
            raise RequestTimedOut(
                f"request timed out after {timeout.total:.0f} s: {exc.__class__.__name__}"
            ) from exc
        except aiohttp.ClientError as exc:
            raise EngineDown(f"engine unreachable: {exc.__class__.__name__}: {exc}") from exc

    def _deadline(self, timeout_s: float) -> aiohttp.ClientTimeout:
        return aiohttp.ClientTimeout(total=timeout_s, connect=self._timeout.connect)

    async def aclose(self) -> None:
        if self._session is not None:
            await self._session.close()


class EngineClient:
    """Async client for one engine; one instance per worker, shared by every batch.

    Examples:
        EngineClient("http://127.0.0.1:30000", model="m", timeout_s=3600)
        EngineClient(url, thinking=ThinkingSwitch("thinking", default=False))   # DeepSeek
    """

    def __init__(
        self,
        base_url: str,
        *,
        model: str = "default",
        api_key: str | None = None,
        timeout_s: float = 3600.0,
        max_connections: int = 256,
        thinking: ThinkingSwitch | None = None,
    ) -> None:
        headers = {"Content-Type": "application/json", **auth_headers(api_key)}
        self.model = model
        self.timeout_s = timeout_s
        self.thinking = thinking or ThinkingSwitch()
        url = base_url.rstrip("/") + "/v1/chat/completions"
        self._post = _AiohttpPost(url, headers, timeout_s, max_connections)

    async def chat(
        self, record: PromptRecord, params: GenerationParams, timeout_s: float | None = None
    ) -> ChatResult:
        """One completion; `timeout_s` is this request's deadline (default the client's)."""
        body = orjson.dumps(request_body(record, params, self.model, self.thinking))
        started = time.monotonic()
        status, payload, retry_after = await self._post(body, timeout_s)
        if status == 200:
            try:
                data = orjson.loads(payload)
            except orjson.JSONDecodeError as exc:
                raise RequestFailed(200, "bad_response", f"not JSON: {exc}") from exc
            return parse_chat(data, time.monotonic() - started)
        raise answer_error(status, payload, retry_after)

    async def aclose(self) -> None:
        await self._post.aclose()
