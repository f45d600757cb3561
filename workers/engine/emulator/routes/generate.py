"""POST /generate, SGLang's native API: `text` or `input_ids`, single or batched (§3).

A `text` prompt is tokenized with the emulator's tokenizer; then ids are split at the last
generation prompt of the chat template (`sim/generation_prompt.py`): what follows it is output
the model already drew, and the answer goes on from there token-exactly (`sim/answer.py`):
ids `prompt + first k output ids` with `max_new_tokens = M - k` stream exactly the rest of
what `prompt` with `M` streams, with the same finish. `output_ids`/`text` hold this request's
tokens only (never the EOS); `meta_info.prompt_tokens` is the whole input, `completion_tokens`
what this request generated.

Streams carry the cumulative `text`/`output_ids` in every chunk (SGLang's default, which
bench_serving relies on), or with `--incremental-streaming-output` only what is new since the
last chunk; `meta_info` gains `finish_reason`, `e2e_latency` and the speculative fields only
on a sequence's final chunk.

Refusals are SGLang's: before a stream starts body A (a malformed request, the 503 of a full
queue) or body B (a ValueError of the tokenizer manager: a prompt longer than the context, a
budget past it, a sampling value out of range); once streaming, a 200 whose one chunk is
`{"error": {"message", "type": "invalid_request_error", "code", "retryable"}}`. The emulated
faults are the chat route's, drawn from the same seeded sequence: a 429 (`rate_limited`) and an
abort (`abort_early`). Each prompt is logged, when a request log is kept, as the chat request
it stands for (`request_log.py`).
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

from aiohttp import web

from genfleet.workers.engine.emulator.routes.error_bodies import (
    SSE_DONE,
    ApiError,
    json_response,
    sse,
)
from genfleet.workers.engine.emulator.routes.validate import (
    check_sampling,
    opt_float,
    opt_int,
    read_json,
)
from genfleet.workers.engine.emulator.sim.answer import Answer
from genfleet.workers.engine.emulator.sim.model import Sequence
from genfleet.workers.engine.emulator.sim.stepper import Engine

SCHEMA = "GenerateReqInput"
DEFAULT_MAX_NEW_TOKENS = 128
ABORT_MESSAGE = "Abort in running batch (emulated: --emulator-abort-rate)."


def meta_info(seq: Sequence, engine: Engine, final: bool) -> dict[str, Any]:
    """A sequence's meta_info; the final one says why it stopped and how speculation went."""
    meta: dict[str, Any] = {
        "id": seq.rid,
        "finish_reason": None,
        "prompt_tokens": seq.prompt_tokens,
        "weight_version": "default",
        "num_retractions": 0,
        "reasoning_tokens": 0,
        "completion_tokens": seq.generated,
        "cached_tokens": 0,
    }
    if not final or seq.finished_s is None:
        return meta
    if seq.finish_reason == "stop":
        meta["finish_reason"] = {"type": "stop", "matched": engine.eos_id}
    elif seq.finish_reason == "abort":
        meta["finish_reason"] = {
            "type": "abort",
            "message": ABORT_MESSAGE,
            "status_code": None,
            "err_type": None,
        }
    else:
        meta["finish_reason"] = {"type": "length", "length": seq.generated}
    meta["e2e_latency"] = seq.finished_s - seq.arrived_s
    spec = engine.args.spec
    if spec is not None and seq.verify_ct > 0:
        proposed = seq.verify_ct * (spec.num_draft_tokens - 1)
        meta |= {
            "spec_accept_rate": seq.correct_drafts / proposed if proposed else 0.0,
            "spec_accept_length": seq.generated / seq.verify_ct,
            "spec_num_correct_drafts": seq.correct_drafts,
            "spec_num_proposed_drafts": proposed,
            "spec_verify_ct": seq.verify_ct,
            "spec_accepted_drafts": seq.correct_drafts,
            "spec_proposed_drafts": proposed,
            "spec_correct_drafts_histogram": list(seq.histogram),
            "spec_accept_histogram": list(seq.histogram),
        }
    if engine.args.enable_metrics:
        meta |= _timings(seq, engine)
    return meta


def _timings(seq: Sequence, engine: Engine) -> dict[str, Any]:
    """The --enable-metrics timestamps, as wall-clock seconds."""
    wall = time.time() - engine.clock()
    admitted = seq.admitted_s if seq.admitted_s is not None else seq.arrived_s
    first = seq.first_token_s if seq.first_token_s is not None else admitted
    finished = seq.finished_s if seq.finished_s is not None else first
    decode_s = finished - first
    return {
        "queue_time": admitted - seq.arrived_s,
        "forward_entry_time": wall + admitted,
        "prefill_finished_time": wall + first,
        "request_received_ts": wall + seq.arrived_s,
        "api_server_dispatch_finish_ts": wall + seq.arrived_s,
        "response_sent_to_client_ts": wall + finished,
        "request_finished_ts": wall + finished,
        "decode_throughput": seq.generated / decode_s if decode_s > 0 else 0.0,
    }


def _prompts(body: dict[str, Any]) -> tuple[bool, list[str | list[int]]]:
    """(batched?, [the text or the ids of each prompt])."""
    text, ids = body.get("text"), body.get("input_ids")
    if isinstance(text, str):
        return False, [text]
    if isinstance(text, list) and text and all(isinstance(t, str) for t in text):
        return True, list(text)
    if isinstance(ids, list) and ids and all(_is_id(i) for i in ids):
        return False, [ids]
    if isinstance(ids, list) and ids and all(isinstance(i, list) for i in ids):
        if all(one and all(_is_id(i) for i in one) for one in ids):
            return True, list(ids)
    raise ApiError(400, "Either text, input_ids or input_embeds should be provided.")


def _is_id(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def inputs(body: dict[str, Any], engine: Engine) -> tuple[bool, list[list[int]], dict[str, Any]]:
    """(batched?, each prompt's ids, the sampling_params); a `text` prompt is tokenized."""
    batched, prompts = _prompts(body)
    params = body.get("sampling_params") or {}
    if isinstance(params, list):
        params = params[0] if params else {}
    if not isinstance(params, dict):
        raise ApiError(400, "sampling_params must be a dict.")
    encode = engine.tokenizer.encode
    ids = [encode(prompt, True) if isinstance(prompt, str) else prompt for prompt in prompts]
    return batched, ids, params


def parse(prompts: list[list[int]], params: dict[str, Any], engine: Engine) -> list[Sequence]:
    """Validate the sampling_params and plan one sequence a prompt; raises ApiError like
    SGLang's tokenizer manager."""
    max_new = opt_int(params, "max_new_tokens", SCHEMA)
    check_sampling(
        temperature=opt_float(params, "temperature", SCHEMA),
        top_p=opt_float(params, "top_p", SCHEMA),
        top_k=opt_int(params, "top_k", SCHEMA),
        min_p=opt_float(params, "min_p", SCHEMA),
        max_new_tokens=max_new,
    )
    max_new = DEFAULT_MAX_NEW_TOKENS if max_new is None else max_new
    seqs = []
    for ids in prompts:
        limit = engine.check_lengths(len(ids), max_new)
        seq = engine.plan_answer(
            ids,
            limit,
            ignore_eos=params.get("ignore_eos") is True,
            min_new=opt_int(params, "min_new_tokens", SCHEMA) or 0,
        )
        seqs.append(seq)
    return seqs


def abort_early(seqs: list[Sequence]) -> None:
    """The scheduler aborts these sequences a third of the way through what this request was
    to write: a 200 whose final meta_info says `{"type": "abort", …}`, the tokens drawn so far
    sent (as SGLang streams a request aborted while running)."""
    for seq in seqs:
        seq.target_tokens = min(seq.target_tokens, max(1, seq.target_tokens // 3))
        seq.finish_reason = "abort"


def rate_limited(retry_after_s: float) -> web.Response:
    """A 429 with Retry-After. SGLang itself has no 429; this is the shape its HTTPException
    handler gives any status it raises (as its queue-full 503 on /generate: body A, the type
    the status code)."""
    body = ApiError(429, "Rate limit reached, retry after the time in Retry-After.", "429")
    response = json_response(body.body_a(), 429)
    response.headers["Retry-After"] = f"{retry_after_s:g}"
    return response


def result(seq: Sequence, engine: Engine, final: bool = True, since: int = 0) -> dict[str, Any]:
    """A sequence's answer so far: its tokens from `since` on (0: all of this request's)."""
    answer: Answer = seq.answer
    answer.upto(seq.generated)
    return {
        "text": "".join(answer.pieces[since : seq.generated]),
        "output_ids": answer.ids[since : seq.generated],
        "meta_info": meta_info(seq, engine, final),
    }


async def generate(request: web.Request) -> web.StreamResponse:
    """POST /generate; each prompt logged with its outcome, as the chat request it stands for,
    when a request log is kept (`request_log.py`). The emulated faults are drawn as on the
    chat route: a 429 (`rate_limited`) or an abort (`abort_early`)."""
    engine: Engine = request.app["engine"]
    engine.count_request()
    try:
        body = await read_json(request, SCHEMA)
    except ApiError as exc:
        return json_response(exc.body_a(), exc.status)
    stream = body.get("stream") is True
    try:
        batched, prompts, params = inputs(body, engine)
    except ApiError as exc:
        return await _refuse(request, exc, stream)
    logged = {"max_new_tokens": DEFAULT_MAX_NEW_TOKENS, **params}  # the budget, said or not

    def log(outcome: str, seqs: list[Sequence] | None = None) -> None:
        for i, ids in enumerate(prompts):
            engine.log_generate(ids, body, logged, outcome, seqs[i].rid if seqs else None)

    engine.check_crash_prompt(prompts, body, logged)
    fault = engine.draw_fault()
    if fault == "429":
        log("429")
        return rate_limited(engine.knobs.retry_after_s)
    waker = asyncio.Event()
    try:
        seqs = parse(prompts, params, engine)
        if isinstance(body.get("rid"), str) and not batched:
            seqs[0].rid = body["rid"]
        if fault == "abort":
            abort_early(seqs)
        engine.submit(seqs, waker, stream)
    except ApiError as exc:
        log(str(exc.status))
        return await _refuse(request, exc, stream)
    log(fault or "ok", seqs)
    if not stream:
        await engine.wait(seqs, waker)
        for seq in seqs:
            engine.log_end(seq.rid, [seq])
        out = [result(seq, engine) for seq in seqs]
        return json_response(out if batched else out[0])
    return await _stream(request, seqs, batched, engine, waker)


def _sse_response() -> web.StreamResponse:
    return web.StreamResponse(
        headers={"Content-Type": "text/event-stream; charset=utf-8", "Cache-Control": "no-cache"}
    )


async def _refuse(request: web.Request, exc: ApiError, stream: bool) -> web.StreamResponse:
    """A refusal as SGLang answers it: in-stream when streaming, else body B (A for a 503)."""
    if stream:
        resp = _sse_response()
        await resp.prepare(request)
        await resp.write(sse(exc.generate_stream_chunk()) + SSE_DONE)
        return resp
    return json_response(exc.body_a() if exc.status == 503 else exc.body_b(), exc.status)


async def _stream(
    request: web.Request,
    seqs: list[Sequence],
    batched: bool,
    engine: Engine,
    waker: asyncio.Event,
) -> web.StreamResponse:
    resp = _sse_response()
    await resp.prepare(request)
    sent = [0] * len(seqs)
    closed = [False] * len(seqs)
    try:
        while True:
            out = []
            for i, seq in enumerate(seqs):
                if closed[i] or (seq.generated == sent[i] and not seq.done):
                    continue
                since = sent[i] if engine.args.incremental_streaming_output else 0
                chunk = result(seq, engine, final=seq.done, since=since)
                if batched:
                    chunk["index"] = i
                out.append(sse(chunk))
                sent[i], closed[i] = seq.generated, seq.done
            if out:
                await resp.write(b"".join(out))
                engine.streamed(max(sent))
            if all(closed):
                break
            await waker.wait()
            waker.clear()
        await resp.write(SSE_DONE)
    finally:
        if not all(seq.done for seq in seqs):
            engine.abort(seqs)
        for seq in seqs:
            engine.log_end(seq.rid, [seq])
    return resp
