"""Answers drawn by token ids through SGLang's native API, so a cut answer goes on where it was.

A prompt is rendered to ids by the engine itself (`POST /v1/tokenize` with the chat's
`messages` and `chat_template_kwargs`: the very template and tokenizer its chat endpoint
uses), and the answer streams from `POST /generate` with those `input_ids`. Each chunk brings
the new output ids and their text (`--incremental-streaming-output`, which genfleet starts
SGLang with; a server streaming cumulative chunks is read too). The ids are kept (`Drawn`):
when the engine dies or the worker is killed mid-answer, the next try sends prompt ids + the
drawn ids with `max_new_tokens` less what was drawn, and the answer goes on token-exactly.

What the chat endpoint would have done is done here, so an answer drawn this way is the one
the chat endpoint would have sampled:
- sampling: the run's values, a prompt's own, else the checkpoint's generation-config
  defaults (`workers/engine/sampling_defaults`), as the chat endpoint fills them;
- reasoning apart from content (`workers/feeding/reasoning`), reasoning tokens counted;
- finish reasons `stop`/`length`; an `abort`, an in-stream error or a cut stream is a failed
  try (its ids kept), exactly as `EngineClient` maps them.
Where a term of the answer depends on what was drawn before (repetition/presence/frequency
penalties), on a grammar (response_format, regex, ebnf) or on the chat endpoint's own output
(logprobs), the answer is drawn by the chat endpoint and starts over after a cut, and its
record says why (`native_refusal`).

A server error of `/v1/tokenize` fails that try of the answer (the feeder sends it again, and
it is rendered again: it keeps its ids); only TOKENIZE_FAILURES_IN_A_ROW of them with no
rendered prompt between say that the engine renders none (`Rendering`): every answer then
goes through the chat endpoint, for good.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import orjson

from genfleet.common.errors import (
    AnswerInterrupted,
    ConfigError,
    EngineDown,
    EngineUnreachable,
    RequestFailed,
    RequestTimedOut,
)
from genfleet.common.records import GenerationParams, PromptRecord, Usage
from genfleet.workers.engine.launch import auth_headers
from genfleet.workers.engine.sglang_argv import parse_release
from genfleet.workers.feeding.client import (
    ChatResult,
    EngineClient,
    ThinkingSwitch,
    answer_error,
    in_stream_error,
    loop_figures,
    template_kwargs,
)
from genfleet.workers.feeding.drawn import Drawn
from genfleet.workers.feeding.reasoning import THINK_END, reasoning_token_count
from genfleet.workers.feeding.repetition import RepetitionRule, prompt_text
from genfleet.workers.feeding.stream import END, json_object, sse_event
from genfleet.workers.feeding.transport import AiohttpTransport, Transport

log = logging.getLogger("genfleet.feeder")

# A prompt's own fields drawn by ids as given (OpenAI name → SGLang sampling_params name).
SAMPLING_NAMES = {
    "temperature": "temperature",
    "top_p": "top_p",
    "top_k": "top_k",
    "min_p": "min_p",
    "seed": "sampling_seed",
    "stop": "stop",
    "stop_token_ids": "stop_token_ids",
    "ignore_eos": "ignore_eos",
    "skip_special_tokens": "skip_special_tokens",
}
# Fields that make the answer depend on more than its prefix, or that only the chat endpoint
# answers: such answers start over after a cut, and say why.
PENALTIES = {"repetition_penalty": 1.0, "presence_penalty": 0.0, "frequency_penalty": 0.0}
GRAMMARS = ("response_format", "regex", "ebnf")
CHAT_ONLY = {
    "logprobs": "logprobs come from the chat endpoint",
    "top_logprobs": "logprobs come from the chat endpoint",
    "logit_bias": "logit_bias is the chat endpoint's",
    "reasoning_effort": "reasoning_effort is rendered by the chat endpoint",
}
# Fields that change nothing of what is drawn.
IGNORED = ("max_tokens", "min_tokens", "chat_template_kwargs", "user", "n")
DEFAULTED = ("top_k", "min_p")  # filled from the checkpoint's generation config when unset


# The oldest SGLang whose /v1/tokenize renders a chat (`messages`) with its template (read in
# 0.5.15's serving_tokenize.py; 0.5.11's tokenizes plain prompts only).
TOKENIZE_CHAT_SGLANG = (0, 5, 15)


# Server errors of /v1/tokenize in a row, no prompt rendered between them, that say the engine
# renders no prompt at all. SGLang 0.5.15 answers 500 to every one for a checkpoint whose
# tokenizer sets no model_max_length: its first answers fail at once, three of them within
# the first second of a batch. An engine restarting or overloaded answers the odd 5xx between
# prompts it renders, and one of those must not switch a run off going on from ids. Each
# error below the count costs its answer one failed try (sent again after its backoff).
TOKENIZE_FAILURES_IN_A_ROW = 3


@dataclass(slots=True)
class Rendering:
    """Whether the engine renders prompts to ids, from its /v1/tokenize answers: the server
    errors in a row (`failures`; a prompt rendered sets it back to 0) and, once they reach
    TOKENIZE_FAILURES_IN_A_ROW, why it renders none (`unrendered`, for good)."""

    failures: int = 0
    unrendered: str | None = None

    def rendered(self) -> None:
        self.failures = 0

    def failed(self, error: str) -> bool:
        """One more server error (`error`, the last one's words); True when it is the one
        that says the engine renders no prompt."""
        self.failures += 1
        if self.unrendered is not None or self.failures < TOKENIZE_FAILURES_IN_A_ROW:
            return False
        self.unrendered = (
            f"the engine's /v1/tokenize failed {self.failures} times in a row (the last: "
            f"{error}): no prompt ids to draw from"
        )
        return True


# SGLang's reasoning parsers whose reasoning sits between `<think>` and `</think>` in the raw
# text, as ReasoningSplit splits it (parser/reasoning_parser.py). Others mark it otherwise
# (kimi's ◁think▷, gpt-oss's channels) or add their own rules (glm45, minimax's appended
# `<think>`): their answers are drawn by the chat endpoint, whose parser splits them.
THINK_MARKER_PARSERS = frozenset({"qwen3", "qwen3-thinking", "deepseek-r1", "deepseek-v3"})


def engine_reasoning_parser(
    engine_kind: str | None, info: Mapping[str, Any], chosen: str | None
) -> str | None:
    """The reasoning parser the engine's chat endpoint runs: for an external engine what its
    /server_info says it was started with (the worker cannot choose it), else the one the
    worker started it with (`chosen`)."""
    if engine_kind == "external" and "reasoning_parser" in info:
        parser = info.get("reasoning_parser")
        return parser if isinstance(parser, str) and parser else None
    return chosen


def splits_reasoning(parser: str | None) -> bool:
    """Whether an answer drawn by ids can be split into reasoning and content as the engine's
    parser `parser` splits a chat answer (no parser: all content, nothing to split)."""
    return parser is None or parser in THINK_MARKER_PARSERS


def draws_by_ids(engine_kind: str | None, info: Mapping[str, Any]) -> bool:
    """Whether a worker's engine can render prompts to ids and draw answers by them: the
    emulator, or SGLang from TOKENIZE_CHAT_SGLANG on — supervised, or an external engine whose
    /server_info is SGLang's (its server args with `model_path` and `tp_size`, and its
    `version`). An unknown version, or an external engine of another kind: no."""
    if engine_kind == "emulator":
        return True
    version = info.get("version")
    sglang = engine_kind == "sglang" or (
        engine_kind == "external" and "model_path" in info and "tp_size" in info
    )
    if not sglang or not isinstance(version, str) or not version:
        return False
    try:
        return parse_release(version) >= TOKENIZE_CHAT_SGLANG
    except ConfigError:
        return False


def native_refusal(
    record: PromptRecord, params: GenerationParams, defaults: Mapping[str, Any] | None
) -> str | None:
    """Why this answer cannot be drawn by ids and continued after a cut (None: it can).

    Pure: the run's parameters, the prompt's own fields and the checkpoint's sampling
    defaults (None: unread) decide."""
    own = dict(record.params or {})
    for name, why in CHAT_ONLY.items():
        if own.get(name) not in (None, False):
            return why
    fmt = own.get("response_format", params.response_format)
    if any(own.get(name) for name in ("regex", "ebnf")) or (
        isinstance(fmt, dict) and fmt.get("type") not in (None, "text")
    ):
        return "a grammar (response_format, regex, ebnf) starts from the answer's beginning"
    for name, neutral in PENALTIES.items():
        value = own.get(name, getattr(params, name, None))
        if value is None and defaults is not None:
            value = defaults.get(name)
        if value is not None and float(value) != neutral:
            return f"{name} {value} depends on the tokens drawn before the cut"
    unknown = [name for name in own if name not in SAMPLING_NAMES and name not in IGNORED]
    unknown = [name for name in unknown if name not in PENALTIES and name not in GRAMMARS]
    if unknown:
        return f"{', '.join(sorted(unknown))}: the chat endpoint's"
    if defaults is None:
        # What the checkpoint's generation config would fill in, the chat endpoint knows and
        # this worker does not: a repetition_penalty in it would make the answer start over.
        unset = [
            n
            for n in (*DEFAULTED, "repetition_penalty")
            if own.get(n) is None and getattr(params, n) is None
        ]
        if unset:
            return (
                f"{', '.join(unset)} unset and the checkpoint's generation config unread: "
                "only the chat endpoint knows its defaults"
            )
    return None


def sampling_params(
    record: PromptRecord,
    params: GenerationParams,
    defaults: Mapping[str, Any] | None,
    drawn_tokens: int,
) -> dict[str, Any]:
    """`/generate`'s sampling_params for an answer `drawn_tokens` into its budget: the run's
    values, the prompt's own over them, the checkpoint's defaults for what both leave unset
    (as the chat endpoint's `to_sampling_params`), the budget less what was drawn."""
    own = dict(record.params or {})
    sampling: dict[str, Any] = dict(defaults or {})
    sampling.pop("repetition_penalty", None)  # neutral, or the answer is not drawn here
    sampling.update({"temperature": params.temperature, "top_p": params.top_p})
    for name in DEFAULTED:
        if getattr(params, name) is not None:
            sampling[name] = getattr(params, name)
    for name, engine_name in SAMPLING_NAMES.items():
        if own.get(name) is not None:
            sampling[engine_name] = own[name]
    max_tokens = int(own.get("max_tokens") or params.max_tokens)
    sampling["max_new_tokens"] = max(max_tokens - drawn_tokens, 0)
    if own.get("min_tokens"):
        sampling["min_new_tokens"] = max(int(own["min_tokens"]) - drawn_tokens, 0)
    return sampling


def finish_of(meta: Mapping[str, Any]) -> str | None:
    """`meta_info.finish_reason` → the chat endpoint's finish_reason (None: not finished)."""
    reason = meta.get("finish_reason")
    if reason is None:
        return None
    kind = reason.get("type") if isinstance(reason, dict) else reason
    return str(kind) if kind else None


class GenerateStream:
    """One `/generate` stream into the answer's `Drawn`; `feed(line)` → True once it must
    stop. Reads incremental chunks (new ids and text) and cumulative ones (all so far)."""

    __slots__ = (
        "drawn",
        "finish_reason",
        "matched",
        "error",
        "done",
        "request_id",
        "new_ids",
        "new_chars",
        "on_begun",
        "on_tokens",
    )

    def __init__(
        self,
        drawn: Drawn,
        on_begun: Callable[[], None] | None = None,
        on_tokens: Callable[[int], None] | None = None,
    ) -> None:
        self.drawn = drawn
        self.finish_reason: str | None = None
        self.matched: str | None = None  # the stop string the engine matched, if one
        self.error: dict[str, Any] | None = None
        self.done = False
        self.request_id: str | None = None
        self.new_ids = 0  # ids this stream added
        self.new_chars = 0  # characters of text this stream added (cumulative chunks)
        self.on_begun = on_begun
        self.on_tokens = on_tokens

    def feed(self, line: bytes) -> bool:
        chunk = sse_event(line)
        if chunk is None:
            return False
        if chunk is END:
            self.done = True
            return True
        if "error" in chunk:
            self.error = chunk["error"] if isinstance(chunk["error"], dict) else chunk
            return True
        meta = chunk.get("meta_info") or {}
        if self.request_id is None:
            self.request_id = meta.get("id")
        ids, text = self._delta(chunk, meta)
        stop = False
        if ids or text:
            if self.on_begun is not None:
                self.on_begun()
                self.on_begun = None
            self.new_ids += len(ids)
            self.new_chars += len(text)
            stop = self.drawn.add(ids, text)
            if ids and self.on_tokens is not None:
                self.on_tokens(len(ids))
        finish = finish_of(meta)
        if finish is not None:
            self.finish_reason = finish
            self.drawn.ended = finish != "abort"  # an aborted answer goes on from its ids
            reason = meta.get("finish_reason")
            matched = reason.get("matched") if isinstance(reason, dict) else None
            self.matched = matched if isinstance(matched, str) else None
        return stop

    def _delta(self, chunk: dict[str, Any], meta: Mapping[str, Any]) -> tuple[list[int], str]:
        """The ids and text this chunk adds. A chunk whose ids are as many as the request's
        `completion_tokens` so far holds all of them (cumulative), else only the new ones."""
        ids = chunk.get("output_ids") or []
        text = chunk.get("text") or ""
        so_far = meta.get("completion_tokens")
        if isinstance(so_far, int) and self.new_ids and len(ids) == so_far:
            return list(ids[self.new_ids :]), text[self.new_chars :]
        return list(ids), text


def stream_failure(stream: GenerateStream) -> None:
    """Raise what a 200 stream that did not finish stands for, as `EngineClient` maps it:
    an in-stream error as its code's status; an abort or a cut stream as a failed try (the
    ids it drew stay with the answer)."""
    drawn = stream.drawn
    if stream.error is not None:
        raise in_stream_error(stream.error)
    if drawn.guard.loop is None and stream.finish_reason is None:
        raise RequestFailed(
            200,
            "bad_response",
            f"the stream ended before its finish (request {stream.request_id}, "
            f"{stream.new_ids} tokens drawn in it, kept)",
            tokens=stream.new_ids,
        )
    if stream.finish_reason == "abort":
        raise RequestFailed(
            200,
            "abort",
            f"the engine aborted the request after {len(drawn.ids)} tokens "
            f"(request {stream.request_id}; the drawn ones kept)",
            tokens=stream.new_ids,
        )


class NativeClient:
    """The client of an engine with SGLang's native API (SGLang, the emulator): answers that
    can be continued are drawn by ids (`draw`), the others through the chat endpoint."""

    def __init__(
        self,
        base_url: str,
        chat: EngineClient,
        *,
        api_key: str | None = None,
        reasoning_parser: str | None = None,
        sampling_defaults: Mapping[str, Any] | None = None,
        max_connections: int = 256,
        transports: tuple[Transport, Transport, Transport] | None = None,
    ) -> None:
        """`chat`: the chat endpoint's client, for what cannot be drawn by ids (its thinking
        switch, guard and timeout are this client's too). `reasoning_parser`: the engine's
        (None: no reasoning is split out, as its chat endpoint would not). `transports`:
        (tokenize, generate, detokenize), by default aiohttp to `base_url`."""
        self.chat_client = chat
        self.model = chat.model
        self.thinking: ThinkingSwitch = chat.thinking
        self.repetition: RepetitionRule | None = chat.repetition
        self.timeout_s = chat.timeout_s
        self.reasoning_parser = reasoning_parser
        self.sampling_defaults = sampling_defaults
        self.think_end_id: int | None = None
        self.rendering = Rendering()
        if transports is None:
            headers = {"Content-Type": "application/json", **auth_headers(api_key)}
            root = base_url.rstrip("/")
            transports = (
                AiohttpTransport(root + "/v1/tokenize", headers, 60.0, max_connections),
                AiohttpTransport(root + "/generate", headers, chat.timeout_s, max_connections),
                AiohttpTransport(root + "/v1/detokenize", headers, 60.0, max_connections),
            )
        self._tokenize, self._generate, self._detokenize = transports

    def refusal(self, record: PromptRecord, params: GenerationParams) -> str | None:
        """Why this answer cannot be drawn by ids (None: it can): the prompt's fields, or an
        engine that renders no prompt."""
        if self.rendering.unrendered is not None:
            return self.rendering.unrendered
        return native_refusal(record, params, self.sampling_defaults)

    def drawing(self, record: PromptRecord, params: GenerationParams) -> Drawn | str:
        """A new answer's `Drawn` when it can be drawn by ids, else why not."""
        refusal = self.refusal(record, params)
        if refusal is not None:
            return refusal
        return Drawn(in_reasoning=bool(self.reasoning_parser) and self._thinks(record, params))

    def _thinks(self, record: PromptRecord, params: GenerationParams) -> bool:
        """Whether the answer is to think: the switch's value as the template will see it."""
        kwargs = template_kwargs(record, params, self.thinking)
        key = self.thinking.key
        if key and key in kwargs:
            return bool(kwargs[key])
        return params.thinking

    async def chat(
        self,
        record: PromptRecord,
        params: GenerationParams,
        timeout_s: float | None = None,
        on_begun: Callable[[], None] | None = None,
        on_tokens: Callable[[int], None] | None = None,
        drawn: Drawn | None = None,
    ) -> ChatResult:
        """One try at the answer: by ids, going on from `drawn`, or (None) by the chat
        endpoint, from its beginning. A prompt the engine fails to render is a failed try
        (RequestFailed), never an answer from another endpoint: whether the next try goes
        by ids is `refusal`'s to say."""
        if drawn is None:
            return await self.chat_client.chat(record, params, timeout_s, on_begun, on_tokens)
        started = time.monotonic()
        if drawn.prompt_ids is None:
            drawn.prompt_ids = await self._render(record, params, timeout_s)
        if self.think_end_id is None and drawn.in_reasoning:
            self.think_end_id = await self._single_id(THINK_END, timeout_s)
        rule = None if params.repetition_guard is False else self.repetition
        drawn.watch(rule, prompt_text(record.messages) if rule is not None else "")
        before = len(drawn.ids)
        sampling = sampling_params(record, params, self.sampling_defaults, before)
        if before and sampling["max_new_tokens"] == 0:
            return self._result(drawn, "length", started, None, params, record)
        if before:
            drawn.resumed_tokens += before
        body = orjson.dumps(
            {
                "input_ids": [*drawn.prompt_ids, *drawn.ids],
                "sampling_params": sampling,
                "stream": True,
            }
        )
        stream = GenerateStream(drawn, on_begun, on_tokens)
        try:
            status, payload, retry_after = await self._generate.stream(body, stream, timeout_s)
        except (EngineUnreachable, RequestTimedOut):
            raise
        except EngineDown as exc:
            if stream.new_ids:
                raise AnswerInterrupted(f"{exc} (after {stream.new_ids} tokens)") from exc
            raise
        if status != 200:
            raise answer_error(status, payload, retry_after)
        stream_failure(stream)
        if drawn.resumed_tokens and drawn.guard.loop is None:
            skip = bool(sampling.get("skip_special_tokens", True))
            await self._retext(drawn, stream.matched, skip, timeout_s)
        return self._result(drawn, stream.finish_reason, started, stream.request_id, params, record)

    async def _retext(
        self, drawn: Drawn, matched: str | None, skip_special: bool, timeout_s: float | None
    ) -> None:
        """An answer gone on from a cut: its text is decoded again from all of its ids. The
        engine's streamed text holds back the bytes of a character cut between two tokens
        until the next one completes it, so the pieces streamed before and after a cut need
        not add up to the answer's text; the ids do. A stop string the engine matched is
        trimmed, as it trims it from a streamed answer."""
        fields = {
            "model": self.model,
            "tokens": list(drawn.ids),
            "skip_special_tokens": skip_special,
        }
        text = (await self._post(self._detokenize, fields, timeout_s)).get("text")
        if not isinstance(text, str):
            raise RequestFailed(200, "bad_response", f"/v1/detokenize gave no text: {text!r:.200}")
        if matched and text.endswith(matched):
            text = text[: -len(matched)]
        drawn.retext(text)

    def _result(
        self,
        drawn: Drawn,
        finish: str | None,
        started: float,
        request_id: str | None,
        params: GenerationParams,
        record: PromptRecord,
    ) -> ChatResult:
        drawn.finish()
        completion = len(drawn.ids)
        repetition = None
        if drawn.guard.loop is not None:
            finish = "repetition"
            budget = int((record.params or {}).get("max_tokens") or params.max_tokens)
            repetition = loop_figures(drawn, completion, budget)
        reasoning = "".join(drawn.reasoning)
        return ChatResult(
            content="".join(drawn.content),
            reasoning=reasoning or None,
            finish_reason=finish,
            usage=Usage(
                prompt_tokens=len(drawn.prompt_ids or ()),
                completion_tokens=completion,
                reasoning_tokens=reasoning_token_count(
                    drawn.ids, self.think_end_id, drawn.in_reasoning
                ),
            ),
            latency_s=time.monotonic() - started,
            request_id=request_id,
            model=self.model,
            repetition=repetition,
            resumed_tokens=drawn.resumed_tokens,
        )

    async def _render(
        self, record: PromptRecord, params: GenerationParams, timeout_s: float | None
    ) -> list[int]:
        """The prompt's ids, rendered by the engine's own chat template; its server errors
        counted (`Rendering`). The one that says the engine renders no prompt (SGLang 0.5.15
        answers 500 for a checkpoint whose tokenizer sets no model_max_length) is said once,
        loudly: answers are drawn by the chat endpoint from then on, which renders the same
        template, and start over after a cut."""
        fields: dict[str, Any] = {"model": self.model, "messages": record.messages}
        kwargs = template_kwargs(record, params, self.thinking)
        if kwargs:
            fields["chat_template_kwargs"] = kwargs
        try:
            tokens = (await self._post(self._tokenize, fields, timeout_s)).get("tokens")
        except RequestFailed as exc:
            if 500 <= exc.status < 600 and self.rendering.failed(str(exc)):
                log.error(
                    "%s; every answer goes through the chat endpoint and starts over after a "
                    "cut (set model_max_length in the checkpoint's tokenizer_config.json)",
                    self.rendering.unrendered,
                )
            raise
        if not isinstance(tokens, list) or not all(isinstance(i, int) for i in tokens):
            raise RequestFailed(200, "bad_response", f"/v1/tokenize gave no ids: {tokens!r:.200}")
        self.rendering.rendered()
        return tokens

    async def _single_id(self, text: str, timeout_s: float | None) -> int | None:
        """The id of a marker the tokenizer holds as one token (else None: not counted)."""
        fields = {"model": self.model, "prompt": text, "add_special_tokens": False}
        tokens = (await self._post(self._tokenize, fields, timeout_s)).get("tokens")
        return tokens[0] if isinstance(tokens, list) and len(tokens) == 1 else None

    @staticmethod
    async def _post(
        transport: Transport, fields: dict[str, Any], timeout_s: float | None
    ) -> dict[str, Any]:
        """One JSON request, one JSON object back (mapped like any answer when not a 200)."""
        status, payload, retry_after = await transport.stream(
            orjson.dumps(fields), _NoStream(), timeout_s
        )
        if status != 200:
            raise answer_error(status, payload, retry_after)
        return json_object(payload, "not a JSON object")

    async def aclose(self) -> None:
        await self._tokenize.aclose()
        await self._generate.aclose()
        await self._detokenize.aclose()
        await self.chat_client.aclose()


class _NoStream:
    """The sink of a request whose answer is one JSON body, never an event stream."""

    done = True

    def feed(self, line: bytes) -> bool:
        return True
