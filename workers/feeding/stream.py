"""One streamed chat completion, put together from its SSE lines as they arrive.

SGLang's chat stream (sglang-contract.md §3): `data: {chunk}` lines, a first chunk with the
role, `delta.reasoning_content` / `delta.content` pieces (every `--stream-interval` tokens;
with `stream_options.continuous_usage_stats` each carries the usage so far), a finish chunk,
the usage chunk (`choices: []`, `stream_options.include_usage`), then `data: [DONE]`. An
error after the stream started is an in-stream `data: {"error": {…}}` on the HTTP 200.

The repetition guard watches the reasoning and the content as they grow; when either ends in
a loop, `feed` says stop and the client closes the stream (SGLang aborts a request whose
client went away). What was generated is kept, with `finish_reason "repetition"`.

The tokens of an answer are counted as they stream, not when it ends, so that a worker's
tokens per second hold over a window shorter than its answers (`on_tokens`): a chunk that
carries the usage so far counts up to its `completion_tokens` (exact, and a correction of
earlier estimates), one that carries text without it counts `chunk_tokens` (SGLang sends a
chunk every `--stream-interval` tokens).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import orjson

from genfleet.common.errors import RequestFailed
from genfleet.workers.feeding.repetition import AnswerGuard, RepetitionRule

DATA = b"data:"
DONE = b"[DONE]"
END: dict[str, Any] = {}  # `sse_event`'s answer to `data: [DONE]` (compared by identity)


def sse_event(line: bytes) -> dict[str, Any] | None:
    """The JSON object one `data:` line of an answer's stream carries; `END` for
    `data: [DONE]`; None for any other line (blank separators, SSE comments). A line that is
    no JSON object is a RequestFailed: the engine's stream cannot be read."""
    if not line.startswith(DATA):
        return None
    payload = line[len(DATA) :].strip()
    if payload == DONE:
        return END
    return json_object(payload, "not a stream chunk")


def json_object(payload: bytes, what: str) -> dict[str, Any]:
    """The JSON object an engine's 200 carries; anything else is a RequestFailed (`what`, and
    why) that a try cannot read."""
    try:
        data = orjson.loads(payload)
    except orjson.JSONDecodeError as exc:
        raise RequestFailed(200, "bad_response", f"{what}: {exc}") from exc
    if not isinstance(data, dict):
        raise RequestFailed(200, "bad_response", f"{what}: {payload[:200]!r}")
    return data


class ChatStream:
    """The parts of one answer so far; `feed(line)` → True once it must be stopped."""

    __slots__ = (
        "reasoning",
        "content",
        "finish_reason",
        "usage",
        "request_id",
        "model",
        "logprobs",
        "error",
        "done",
        "guard",
        "on_begun",
        "on_tokens",
        "chunk_tokens",
        "streamed_tokens",
    )

    def __init__(
        self,
        rule: RepetitionRule | None,
        on_begun: Callable[[], None] | None = None,
        on_tokens: Callable[[int], None] | None = None,
        chunk_tokens: int = 1,
        prompt: str = "",
    ) -> None:
        """`on_begun()` fires once, at the first reasoning or content text: the prompt is past
        its arrival (prefill and first steps run), which the feeder's crash blame needs.
        `on_tokens(n)` fires at each chunk that moves the count of tokens streamed so far
        (`streamed_tokens`), with the change; `n` is negative where a usage figure corrects
        an estimate of `chunk_tokens` per chunk. `prompt` is the chat's text: the guard never
        stops repetition the prompt holds or asks for."""
        self.reasoning: list[str] = []
        self.content: list[str] = []
        self.finish_reason: str | None = None
        self.usage: dict[str, Any] | None = None  # the last usage seen (final or continuous)
        self.request_id: str | None = None
        self.model: str | None = None
        self.logprobs: list[Any] | None = None
        self.error: dict[str, Any] | None = None
        self.done = False  # `data: [DONE]` arrived
        self.guard = AnswerGuard(rule, prompt)
        self.on_begun = on_begun
        self.on_tokens = on_tokens
        self.chunk_tokens = chunk_tokens
        self.streamed_tokens = 0

    def feed(self, line: bytes) -> bool:
        """One line of the body; True when the answer must stop (a loop, an error, the end)."""
        chunk = sse_event(line)
        if chunk is None:
            return False
        if chunk is END:
            self.done = True
            return True
        if "error" in chunk:
            self.error = chunk["error"] if isinstance(chunk["error"], dict) else chunk
            return True
        if self.request_id is None:
            self.request_id = chunk.get("id")
            self.model = chunk.get("model")
        usage = chunk.get("usage")
        if usage:
            self.usage = usage
        stop = text = False
        for choice in chunk.get("choices") or ():
            if choice.get("index", 0) == 0:
                delta = choice.get("delta") or {}
                text = bool(delta.get("reasoning_content") or delta.get("content"))
                stop = self._choice(choice)
                break
        self._count(usage, text)
        return stop

    def _count(self, usage: Any, text: bool) -> None:
        """Move `streamed_tokens` by one chunk: to its usage's `completion_tokens` where it
        has one, else by `chunk_tokens` where it brought text."""
        so_far = usage.get("completion_tokens") if isinstance(usage, dict) else None
        if isinstance(so_far, int) and not isinstance(so_far, bool):
            change = so_far - self.streamed_tokens
        elif text:
            change = self.chunk_tokens
        else:
            return
        if change:
            self.streamed_tokens += change
            if self.on_tokens is not None:
                self.on_tokens(change)

    def _choice(self, choice: dict[str, Any]) -> bool:
        delta = choice.get("delta") or {}
        finish = choice.get("finish_reason")
        if finish is not None:
            self.finish_reason = finish
        logprobs = choice.get("logprobs")
        if isinstance(logprobs, dict) and logprobs.get("content"):
            # Extended in place: a new list per chunk made a long answer's cost quadratic.
            if self.logprobs is None:
                self.logprobs = []
            self.logprobs.extend(logprobs["content"])
        reasoning = delta.get("reasoning_content") or ""
        content = delta.get("content") or ""
        if self.on_begun is not None and (reasoning or content):
            self.on_begun()
            self.on_begun = None
        if reasoning:
            self.reasoning.append(reasoning)
        if content:
            self.content.append(content)
        return self.guard.feed(reasoning, content)

    @property
    def chars(self) -> int:
        """Characters of reasoning and content received."""
        return sum(map(len, self.reasoning)) + sum(map(len, self.content))
