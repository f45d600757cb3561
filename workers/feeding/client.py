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
  the engine up again (AnswerInterrupted when the answer had begun: the prompt was past its
  arrival, not what killed the engine); a request past its deadline → RequestTimedOut (that
  prompt's error).
Answers stream (SSE, `workers/feeding/stream.py`): an in-stream error chunk maps by its `code`
as the status above would; a stream that ends before its finish chunk is a failed try; an answer the
repetition guard stops is a result with `finish_reason "repetition"` and its `repetition`
figures (where the loop began, the block, the budget it did not spend).
The hot path decodes with orjson and builds no validation models per request. The wire is
`workers/feeding/transport.py`'s (aiohttp by default); `timeout_s` is a deadline for the whole
request (connect, queue on the engine, generation, body), the client's own or the one a call passes
(`workers/feeding/deadline`).
"""

from __future__ import annotations

import email.utils
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import orjson

from genfleet.common.errors import (
    AnswerInterrupted,
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
from genfleet.workers.feeding.drawn import Drawn
from genfleet.workers.feeding.repetition import AnswerGuard, RepetitionRule, prompt_text
from genfleet.workers.feeding.stream import ChatStream
from genfleet.workers.feeding.transport import AiohttpTransport, Transport

# The longest Retry-After honoured: a server asking for more is waited on in steps of this.
MAX_RETRY_AFTER_S = 60.0
# Tokens per streamed chunk, where a chunk does not say: the `--stream-interval` genfleet
# starts SGLang with by default (the setting `stream_chunk_tokens`).
STREAM_CHUNK_TOKENS = 8


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
    repetition: dict[str, Any] | None = None  # the loop the guard stopped (finish "repetition")
    resumed_tokens: int = 0  # tokens drawn before a cut that the answer went on from


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
    if record.params:
        own = dict(record.params)
        own.pop("chat_template_kwargs", None)
        body.update(own)
    kwargs = template_kwargs(record, params, switch)
    if kwargs:
        body["chat_template_kwargs"] = kwargs
    return body


def template_kwargs(
    record: PromptRecord, params: GenerationParams, switch: ThinkingSwitch
) -> dict[str, Any]:
    """The chat template's variables: the thinking switch (only where it differs from the
    template's default), the run's `chat_template_kwargs`, the prompt's own over them."""
    kwargs: dict[str, Any] = {}
    if switch.key and (switch.default is None or params.thinking != switch.default):
        kwargs[switch.key] = params.thinking
    kwargs.update(params.chat_template_kwargs or {})
    kwargs.update((record.params or {}).get("chat_template_kwargs") or {})
    return kwargs


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
            tokens=result.usage.completion_tokens,
        )
    return result


# What genfleet adds to every request: a stream, with the usage so far on every chunk (for the
# tokens of an answer stopped mid-way) and in a final chunk.
STREAM_FIELDS: dict[str, Any] = {
    "stream": True,
    "stream_options": {"include_usage": True, "continuous_usage_stats": True},
}


def streamed_body(body: dict[str, Any]) -> dict[str, Any]:
    """A request body asking for SGLang's stream (a prompt's own stream fields never reach
    here: the readers drop them as genfleet's own)."""
    return {**body, **STREAM_FIELDS}


def in_stream_error(error: dict[str, Any]) -> Exception:
    """An error chunk in a 200 stream, mapped as its `code`'s status would be (a 5xx or no
    code: a failed try)."""
    code = error.get("code")
    status = code if isinstance(code, int) and 400 <= code < 600 else 500
    mapped = answer_error(status, orjson.dumps({"error": error}))
    if isinstance(mapped, RequestFailed) and status == 500:
        mapped = RequestFailed(200, mapped.kind, f"in-stream error: {mapped}")
    return mapped


def stream_result(
    stream: ChatStream, latency_s: float, max_tokens: int | None = None
) -> ChatResult:
    """A finished (or stopped) stream → ChatResult, mapped like a non-streamed answer:
    an in-stream error as its code's status, an abort or a cut stream as a failed try."""
    if stream.error is not None:
        raise in_stream_error(stream.error)
    usage = stream.usage or {}
    completion = int(usage.get("completion_tokens") or 0)
    repetition: dict[str, Any] | None = None
    finish = stream.finish_reason
    if stream.guard.loop is not None:
        finish = "repetition"
        repetition = loop_figures(stream, completion, max_tokens)
        completion = int(repetition["completion_tokens"])
    elif finish is None:
        raise RequestFailed(
            200,
            "bad_response",
            f"the stream ended before its finish chunk (request {stream.request_id}, "
            f"{completion} tokens so far)",
            tokens=completion,
        )
    if finish == "abort":
        raise RequestFailed(
            200,
            "abort",
            f"the engine aborted the request after {completion} tokens "
            f"(finish_reason abort, request {stream.request_id})",
            tokens=completion,
        )
    return ChatResult(
        content="".join(stream.content),
        reasoning="".join(stream.reasoning) or None,
        finish_reason=finish,
        usage=Usage(
            prompt_tokens=int(usage.get("prompt_tokens") or 0),
            completion_tokens=completion,
            reasoning_tokens=min(reasoning_tokens(usage), completion),
        ),
        latency_s=latency_s,
        request_id=stream.request_id,
        model=stream.model,
        logprobs={"content": stream.logprobs} if stream.logprobs is not None else None,
        repetition=repetition,
    )


class LoopedText(Protocol):
    """An answer's text so far and its guard (`ChatStream`, `Drawn`)."""

    reasoning: list[str]
    content: list[str]
    guard: AnswerGuard


def loop_figures(stream: LoopedText, completion: int, max_tokens: int | None) -> dict[str, Any]:
    """Where the stopped loop began and what stopping it saved.

    `completion_tokens` is the engine's count at the last chunk (continuous usage); a server
    that sends none gets an estimate from the text (4 characters a token), said so by
    `tokens_estimated`. `start_token_estimate` scales the loop's first character by the
    answer's own characters per token; `tokens_saved` is the budget not spent.
    """
    loop = stream.guard.loop
    assert loop is not None
    reasoning_chars = sum(map(len, stream.reasoning))
    chars = reasoning_chars + sum(map(len, stream.content))
    estimated = completion == 0
    if estimated:
        completion = (chars + 3) // 4
    before = reasoning_chars if stream.guard.loop_field == "content" else 0
    start = before + loop.start_char
    figures: dict[str, Any] = {
        "field": stream.guard.loop_field,
        **loop.to_json(),
        "start_token_estimate": round(start * completion / chars) if chars else 0,
        "completion_tokens": completion,
        "tokens_saved": max(0, max_tokens - completion) if max_tokens else None,
    }
    if estimated:
        figures["tokens_estimated"] = True
    return figures


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


DEFAULT_RULE = RepetitionRule()
# Why an answer drawn by a chat endpoint alone starts over after a cut.
NO_TOKEN_IDS = "the engine's chat endpoint gives no token ids to go on from"


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
        repetition: RepetitionRule | None = DEFAULT_RULE,
        transport: Transport | None = None,
        stream_chunk_tokens: int = STREAM_CHUNK_TOKENS,
    ) -> None:
        """`transport`: how requests travel (workers/feeding/transport.py); by default aiohttp to
        `base_url` with `api_key`, `timeout_s` and `max_connections`. `stream_chunk_tokens`:
        the engine's `--stream-interval`, the tokens a streamed chunk without usage counts."""
        self.model = model
        self.stream_chunk_tokens = stream_chunk_tokens
        self.timeout_s = timeout_s
        self.thinking = thinking or ThinkingSwitch()
        self.repetition = repetition  # None: the guard is off, answers still stream
        if transport is None:
            headers = {"Content-Type": "application/json", **auth_headers(api_key)}
            url = base_url.rstrip("/") + "/v1/chat/completions"
            transport = AiohttpTransport(url, headers, timeout_s, max_connections)
        self._transport = transport

    async def chat(
        self,
        record: PromptRecord,
        params: GenerationParams,
        timeout_s: float | None = None,
        on_begun: Callable[[], None] | None = None,
        on_tokens: Callable[[int], None] | None = None,
        drawn: Drawn | None = None,
    ) -> ChatResult:
        """One completion, streamed (the guard watching it); `timeout_s` is this request's
        deadline (default the client's); `on_begun()` fires at its first output text;
        `on_tokens(n)` as its tokens stream (`ChatStream`: an estimate until a usage figure).
        `drawn` is never given: `drawing` never makes one."""
        if drawn is not None:
            raise TypeError("the chat endpoint cannot go on from token ids")
        fields = streamed_body(request_body(record, params, self.model, self.thinking))
        body = orjson.dumps(fields)
        # An order may switch the guard off for its answers (a retry of stopped answers).
        rule = None if params.repetition_guard is False else self.repetition
        prompt = prompt_text(record.messages) if rule is not None else ""
        stream = ChatStream(rule, on_begun, on_tokens, self.stream_chunk_tokens, prompt=prompt)
        started = time.monotonic()
        try:
            status, payload, retry_after = await self._transport.stream(body, stream, timeout_s)
        except (EngineUnreachable, RequestTimedOut):
            raise
        except EngineDown as exc:
            if stream.reasoning or stream.content:
                raise AnswerInterrupted(f"{exc} (after {stream.chars} characters)") from exc
            raise
        if status == 200:
            if not payload:
                max_tokens = fields.get("max_completion_tokens") or fields.get("max_tokens")
                return stream_result(stream, time.monotonic() - started, max_tokens)
            try:
                data = orjson.loads(payload)
            except orjson.JSONDecodeError as exc:
                raise RequestFailed(200, "bad_response", f"not JSON: {exc}") from exc
            return parse_chat(data, time.monotonic() - started)
        raise answer_error(status, payload, retry_after)

    def drawing(self, record: PromptRecord, params: GenerationParams) -> Drawn | str:
        """Never by ids: the chat endpoint gives no token ids to go on from."""
        return NO_TOKEN_IDS

    def refusal(self, record: PromptRecord, params: GenerationParams) -> str | None:
        return NO_TOKEN_IDS

    async def aclose(self) -> None:
        await self._transport.aclose()
