"""POST /v1/chat/completions: SGLang's OpenAI-compatible shapes, streaming and not (§3).

Thinking is on unless `chat_template_kwargs.enable_thinking` (or `thinking`) is false or
`reasoning_effort` is "none". A thinking completion spends its first 70 % (of its uncut
length) reasoning; with `--reasoning-parser` set that part is `reasoning_content` and counts
in `usage.reasoning_tokens`, without it the reasoning stays in `content` before `</think>`.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass
from typing import Any

from aiohttp import web

from genfleet.workers.engine.emulator.request_log import CHAT_ENDPOINT
from genfleet.workers.engine.emulator.routes.error_bodies import (
    SSE_DONE,
    ApiError,
    json_response,
    sse,
)
from genfleet.workers.engine.emulator.routes.generate import meta_info
from genfleet.workers.engine.emulator.routes.validate import (
    check_sampling,
    field_error,
    opt_float,
    opt_int,
    read_json,
)
from genfleet.workers.engine.emulator.sim.model import Sequence
from genfleet.workers.engine.emulator.sim.stepper import Engine
from genfleet.workers.engine.emulator.sim.text import (
    CHARS_PER_TOKEN,
    EOS_TOKEN_ID,
    chat_prompt,
    legit_text,
    loop_text,
    prompt_seed,
    synth_text,
)

SCHEMA = "ChatCompletionRequest"
THINK_END = "</think>\n\n"


@dataclass(slots=True)
class Choice:
    """One sequence as the chat API shows it: how it splits into reasoning and content."""

    index: int
    seq: Sequence
    reasoning_tokens: int  # 0 when not thinking
    separate: bool  # reasoning goes to reasoning_content (a parser is set and asked for)
    sent_reasoning: int = 0
    sent_content: int = 0
    finished: bool = False
    eos_id: int = EOS_TOKEN_ID  # the checkpoint's EOS, what `matched_stop` names

    def texts(self, generated: int) -> tuple[str, str]:
        """(reasoning_content, content) after `generated` tokens; each grows by appending.

        A looping answer turns into one block repeated (in its reasoning when it thinks); a
        legitimately repetitive one answers with a table, a list, code, a refrain or an
        enumeration after its reasoning."""
        seq, r_total = self.seq, self.reasoning_tokens
        seed = seq.seed
        r = min(generated, r_total)
        if seq.text_kind == "loop":
            text = loop_text(seed, generated, seq.loop_at, seq.loop_block)
            split = r * CHARS_PER_TOKEN
            reasoning, content = text[:split], text[split:]
        elif seq.text_kind != "plain":
            reasoning = synth_text(seed, r)
            content = legit_text(seq.text_kind, seed, generated - r)
        else:
            reasoning = synth_text(seed, r)
            content = synth_text(seed, generated - r, start=r_total)
        if self.separate or r_total == 0:
            return reasoning, content
        marker = THINK_END if r == r_total else ""
        return "", reasoning + marker + content

    @property
    def matched_stop(self) -> int | None:
        return self.eos_id if self.seq.done and self.seq.finish_reason == "stop" else None


@dataclass(slots=True)
class ChatRequest:
    model: str
    stream: bool
    include_usage: bool
    return_meta_info: bool
    choices: list[Choice]
    continuous_usage: bool = False  # stream_options.continuous_usage_stats: usage per chunk

    @property
    def seqs(self) -> list[Sequence]:
        return [c.seq for c in self.choices]


def wants_thinking(body: dict[str, Any]) -> bool:
    kwargs = body.get("chat_template_kwargs")
    if isinstance(kwargs, dict) and (
        kwargs.get("enable_thinking") is False or kwargs.get("thinking") is False
    ):
        return False
    return body.get("reasoning_effort") != "none"


def parse(body: dict[str, Any], engine: Engine) -> ChatRequest:
    """Validate a chat request and plan its sequences; raises ApiError like SGLang would."""
    messages = body.get("messages")
    if messages is None:
        raise field_error(SCHEMA, "messages", "present (Field required)")
    if not isinstance(messages, list):
        raise field_error(SCHEMA, "messages", "a valid list")
    if not messages:
        raise ApiError(400, "Messages cannot be empty.")
    max_tokens = opt_int(body, "max_completion_tokens", SCHEMA) or opt_int(
        body, "max_tokens", SCHEMA
    )
    n = opt_int(body, "n", SCHEMA) or 1
    check_sampling(
        temperature=opt_float(body, "temperature", SCHEMA),
        top_p=opt_float(body, "top_p", SCHEMA),
        top_k=opt_int(body, "top_k", SCHEMA),
        min_p=opt_float(body, "min_p", SCHEMA),
        max_new_tokens=max_tokens,
    )
    args = engine.args
    if max_tokens is not None and args.context_length_given and max_tokens > args.context_length:
        raise ApiError(
            400,
            f"max_completion_tokens is too large: {max_tokens}.This model supports at most "
            f"{args.context_length} completion tokens.",
        )
    thinking = wants_thinking(body)
    key, prompt_tokens = chat_prompt(messages, thinking)
    max_tokens = engine.check_lengths(prompt_tokens, max_tokens)
    separate = (
        args.reasoning_parser is not None and body.get("separate_reasoning", True) is not False
    )
    base_seed = opt_int(body, "seed", SCHEMA) or 0
    choices = []
    for i in range(n):
        seq = engine.plan(
            prompt_tokens,
            prompt_seed(key, base_seed + i),
            max_tokens,
            ignore_eos=body.get("ignore_eos") is True,
            min_tokens=opt_int(body, "min_tokens", SCHEMA) or 0,
        )
        reasoning = engine.reasoning_tokens(seq) if thinking else 0
        choices.append(Choice(i, seq, reasoning, separate, eos_id=engine.eos_id))
    stream_options = body.get("stream_options")
    return ChatRequest(
        model=str(body.get("model", "default")),
        stream=body.get("stream") is True,
        include_usage=isinstance(stream_options, dict)
        and stream_options.get("include_usage") is True,
        return_meta_info=body.get("return_meta_info") is True,
        choices=choices,
        continuous_usage=isinstance(stream_options, dict)
        and stream_options.get("continuous_usage_stats") is True,
    )


def usage(req: ChatRequest, shape: str = "sglang") -> dict[str, Any]:
    """SGLang's usage (`reasoning_tokens` at top level), or with `shape="openai"` the OpenAI
    one (`completion_tokens_details.reasoning_tokens`), as other servers answer."""
    prompt = req.choices[0].seq.prompt_tokens
    completion = sum(c.seq.generated for c in req.choices)
    reasoning = sum(min(c.reasoning_tokens, c.seq.generated) for c in req.choices if c.separate)
    body: dict[str, Any] = {
        "prompt_tokens": prompt,
        "total_tokens": prompt + completion,
        "completion_tokens": completion,
        "prompt_tokens_details": None,
    }
    if shape == "openai":
        body["completion_tokens_details"] = {"reasoning_tokens": reasoning}
    else:
        body["reasoning_tokens"] = reasoning
    return body


def completion_body(req: ChatRequest, engine: Engine) -> dict[str, Any]:
    choices = []
    for c in req.choices:
        reasoning, content = c.texts(c.seq.generated)
        choice: dict[str, Any] = {
            "index": c.index,
            "message": {
                "role": "assistant",
                "content": content,
                "reasoning_content": reasoning or None,
                "tool_calls": None,
            },
            "logprobs": None,
            "finish_reason": c.seq.finish_reason,
            "matched_stop": c.matched_stop,
        }
        if req.return_meta_info:
            choice["meta_info"] = meta_info(c.seq, engine, final=True)
        choices.append(choice)
    return {
        "id": req.choices[0].seq.rid,
        "object": "chat.completion",
        "created": int(time.time()),
        "model": req.model,
        "choices": choices,
        "usage": usage(req, engine.knobs.usage_shape),
        "metadata": {"weight_version": "default"},
    }


def rate_limited(retry_after_s: float) -> web.Response:
    """What an OpenAI-compatible server answers when it sheds load (SGLang itself has no 429)."""
    body = {
        "error": {
            "message": "Rate limit reached, retry after the time in Retry-After.",
            "type": "rate_limit_error",
            "param": None,
            "code": "rate_limit_exceeded",
        }
    }
    response = json_response(body, 429)
    response.headers["Retry-After"] = f"{retry_after_s:g}"
    return response


def abort_early(req: ChatRequest) -> None:
    """The scheduler aborts these sequences a third of the way: HTTP 200, partial text,
    `finish_reason "abort"` (as SGLang answers when it aborts a request)."""
    for c in req.choices:
        c.seq.target_tokens = max(1, c.seq.target_tokens // 3)
        c.seq.finish_reason = "abort"


def _log(engine: Engine, body: dict[str, Any], outcome: str, rid: str | None) -> None:
    engine.log_request(
        {"body": body, "outcome": outcome, "id": rid, "endpoint": CHAT_ENDPOINT, "drawn_tokens": 0}
    )


async def chat_completions(request: web.Request) -> web.StreamResponse:
    """POST /v1/chat/completions (each request logged with its outcome when a log is kept)."""
    engine: Engine = request.app["engine"]
    engine.count_request()
    try:
        body = await read_json(request, SCHEMA)
    except ApiError as exc:
        return json_response(exc.body_a(), exc.status)
    engine.check_crash(body.get("messages"))
    fault = engine.draw_fault()
    if fault == "429":
        _log(engine, body, "429", None)
        return rate_limited(engine.knobs.retry_after_s)
    try:
        req = parse(body, engine)
    except ApiError as exc:
        _log(engine, body, str(exc.status), None)
        return json_response(exc.body_a(), exc.status)
    if fault == "abort":
        abort_early(req)
    waker = asyncio.Event()
    try:
        engine.submit(req.seqs, waker, req.stream)
    except ApiError as exc:
        _log(engine, body, str(exc.status), None)
        if req.stream:
            return await _stream_error(request, exc)
        return json_response(exc.body_a(), exc.status)
    _log(engine, body, fault or "ok", req.choices[0].seq.rid)
    if not req.stream:
        await engine.wait(req.seqs, waker)
        engine.log_end(req.choices[0].seq.rid, req.seqs)
        return json_response(completion_body(req, engine))
    return await _stream(request, req, engine, waker)


async def _stream_error(request: web.Request, exc: ApiError) -> web.StreamResponse:
    resp = _sse_response()
    await resp.prepare(request)
    await resp.write(sse(exc.chat_stream_chunk()) + SSE_DONE)
    return resp


def _sse_response() -> web.StreamResponse:
    return web.StreamResponse(
        headers={"Content-Type": "text/event-stream; charset=utf-8", "Cache-Control": "no-cache"}
    )


async def _stream(
    request: web.Request, req: ChatRequest, engine: Engine, waker: asyncio.Event
) -> web.StreamResponse:
    resp = _sse_response()
    await resp.prepare(request)
    head: dict[str, Any] = {
        "id": req.choices[0].seq.rid,
        "object": "chat.completion.chunk",
        "created": int(time.time()),
        "model": req.model,
    }
    try:
        first = [
            _chunk(head, c, {"role": "assistant", "content": "", "reasoning_content": None})
            for c in req.choices
        ]
        await resp.write(b"".join(first))
        shape = engine.knobs.usage_shape
        while True:
            so_far = usage(req, shape) if req.continuous_usage else None
            out = [part for c in req.choices for part in _progress(head, c, so_far)]
            if out:
                await resp.write(b"".join(out))
                engine.streamed(max(c.seq.generated for c in req.choices))
            if all(c.finished for c in req.choices):
                break
            await waker.wait()
            waker.clear()
        tail = b""
        if req.include_usage:
            tail = sse({**head, "choices": [], "usage": usage(req, engine.knobs.usage_shape)})
        await resp.write(tail + SSE_DONE)
    finally:
        if not all(seq.done for seq in req.seqs):
            engine.abort(req.seqs)
        engine.log_end(req.choices[0].seq.rid, req.seqs)
    return resp


def _chunk(
    head: dict[str, Any],
    c: Choice,
    delta: dict[str, Any],
    finish: str | None = None,
    so_far: dict[str, Any] | None = None,
) -> bytes:
    choice = {
        "index": c.index,
        "delta": delta,
        "logprobs": None,
        "finish_reason": finish,
        "matched_stop": c.matched_stop if finish else None,
    }
    if so_far is not None:  # continuous_usage_stats: SGLang adds it to every text chunk
        return sse({**head, "choices": [choice], "usage": so_far})
    return sse({**head, "choices": [choice]})


def _progress(head: dict[str, Any], c: Choice, so_far: dict[str, Any] | None) -> list[bytes]:
    """The delta chunks since the last write, and the finish chunk once the sequence is done."""
    if c.finished:
        return []
    out = []
    reasoning, content = c.texts(c.seq.generated)
    if len(reasoning) > c.sent_reasoning:
        part: dict[str, Any] = {"reasoning_content": reasoning[c.sent_reasoning :]}
        out.append(_chunk(head, c, part, so_far=so_far))
        c.sent_reasoning = len(reasoning)
    if len(content) > c.sent_content:
        delta = {"reasoning_content": None, "content": content[c.sent_content :]}
        out.append(_chunk(head, c, delta, so_far=so_far))
        c.sent_content = len(content)
    if c.seq.done:
        out.append(_chunk(head, c, {"reasoning_content": None}, c.seq.finish_reason))
        c.finished = True
    return out
