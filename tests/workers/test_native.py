"""Answers drawn by token ids (`workers/feeding/native.py`): what may be drawn so, the sampling
parameters the chat endpoint would have used, the reasoning split, both stream shapes, an
answer cut mid-stream going on from its ids, and, through the real Feeder, what a
`/v1/tokenize` server error does: once, a failed try; in a row, the chat endpoint for good.

The engine's side of the wire is scripted here (`ScriptedTransport`); the emulator's and real
SGLang's are tested against the same requests in tests/e2e and the GPU tests."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from genfleet.common.errors import AnswerInterrupted, RequestFailed
from genfleet.common.records import CompletionRecord, GenerationParams, PromptRecord
from genfleet.workers.feeding.client import EngineClient, ThinkingSwitch
from genfleet.workers.feeding.drawn import Drawn, worth_keeping
from genfleet.workers.feeding.feeder import Feeder
from genfleet.workers.feeding.native import (
    TOKENIZE_FAILURES_IN_A_ROW,
    GenerateStream,
    NativeClient,
    Rendering,
    draws_by_ids,
    engine_reasoning_parser,
    native_refusal,
    sampling_params,
    splits_reasoning,
)
from genfleet.workers.feeding.reasoning import ReasoningSplit, reasoning_token_count
from tests.fakes.engine import FakeEngine
from tests.fakes.transport import CUT, Answer, Events, ScriptedTransport, Whole

PARAMS = GenerationParams(max_tokens=100, temperature=0.6, top_p=0.95, thinking=True)
QWEN3 = {"temperature": 0.6, "top_p": 0.95, "top_k": 20}


def record(**params: Any) -> PromptRecord:
    return PromptRecord("p1", [{"role": "user", "content": "Why is the sky blue?"}], params=params)


@pytest.mark.parametrize(
    ("own", "run", "defaults", "why"),
    [
        ({}, {}, QWEN3, None),
        ({}, {}, {}, None),
        ({"seed": 7, "stop": ["\n\n"]}, {}, QWEN3, None),
        ({"repetition_penalty": 1.0, "presence_penalty": 0.0}, {}, QWEN3, None),
        ({"presence_penalty": 0.5}, {}, QWEN3, "presence_penalty 0.5"),
        ({"frequency_penalty": 0.2}, {}, QWEN3, "frequency_penalty 0.2"),
        ({}, {"repetition_penalty": 1.1}, QWEN3, "repetition_penalty 1.1"),
        ({}, {}, {"repetition_penalty": 1.05}, "repetition_penalty 1.05"),
        ({"logprobs": True}, {}, QWEN3, "logprobs"),
        ({"regex": "[a-z]+"}, {}, QWEN3, "grammar"),
        ({"response_format": {"type": "json_object"}}, {}, QWEN3, "grammar"),
        ({"response_format": {"type": "text"}}, {}, QWEN3, None),
        ({}, {"response_format": {"type": "json_schema"}}, QWEN3, "grammar"),
        ({"reasoning_effort": "none"}, {}, QWEN3, "reasoning_effort"),
        ({}, {}, None, "generation config unread"),
        ({"top_k": 20}, {"min_p": 0.0}, None, "repetition_penalty unset"),
        ({"top_k": 20}, {"min_p": 0.0, "repetition_penalty": 1.0}, None, None),
    ],
)
def test_which_answers_are_drawn_by_ids(
    own: dict[str, Any], run: dict[str, Any], defaults: dict[str, Any] | None, why: str | None
) -> None:
    params = PARAMS.model_copy(update=run)
    refusal = native_refusal(record(**own), params, defaults)
    if why is None:
        assert refusal is None
    else:
        assert refusal is not None and why in refusal


@pytest.mark.parametrize(
    ("own", "run", "defaults", "drawn", "expected"),
    [
        # the chat endpoint's order: the request's value, else the checkpoint's, else none
        (
            {},
            {},
            QWEN3,
            0,
            {"temperature": 0.6, "top_p": 0.95, "top_k": 20, "max_new_tokens": 100},
        ),
        ({}, {"top_k": 40}, QWEN3, 0, {"top_k": 40}),
        ({"top_k": 5, "temperature": 0.0}, {"top_k": 40}, QWEN3, 0, {"top_k": 5, "temperature": 0}),
        ({}, {}, {"min_p": 0.05}, 0, {"min_p": 0.05}),
        ({"seed": 3}, {}, {}, 0, {"sampling_seed": 3}),
        ({"max_tokens": 50}, {}, {}, 20, {"max_new_tokens": 30}),
        ({"min_tokens": 10}, {}, {}, 4, {"min_new_tokens": 6, "max_new_tokens": 96}),
        ({}, {}, {}, 100, {"max_new_tokens": 0}),
    ],
)
def test_sampling_params_are_the_chat_endpoints(
    own: dict[str, Any],
    run: dict[str, Any],
    defaults: dict[str, Any],
    drawn: int,
    expected: dict[str, Any],
) -> None:
    sampling = sampling_params(record(**own), PARAMS.model_copy(update=run), defaults, drawn)
    assert {k: sampling.get(k) for k in expected} == expected
    assert "repetition_penalty" not in sampling


SGLANG_ARGS = {"model_path": "/models/q36", "tp_size": 1}


@pytest.mark.parametrize(
    ("kind", "info", "expected"),
    [
        ("emulator", {}, True),
        ("sglang", {"version": "0.5.15"}, True),
        ("sglang", {"version": "0.5.23.post1"}, True),
        ("sglang", {"version": "0.5.11"}, False),
        ("sglang", {}, False),
        ("sglang", {"version": "nightly"}, False),
        # an external engine draws by ids where its /server_info is a recent SGLang's
        ("external", {**SGLANG_ARGS, "version": "0.5.23"}, True),
        ("external", {**SGLANG_ARGS, "version": "0.5.11"}, False),
        ("external", {"version": "0.5.23"}, False),  # not SGLang's server args
        ("external", {}, False),  # no /server_info: another kind of engine
        ("command", {**SGLANG_ARGS, "version": "0.5.23"}, False),
    ],
)
def test_which_engines_draw_by_ids(kind: str, info: dict[str, Any], expected: bool) -> None:
    assert draws_by_ids(kind, info) is expected


RAW = [
    # (forced into reasoning, raw text, reasoning, content)
    (True, "Light scatters.\n</think>\n\nRayleigh.", "Light scatters.\n", "Rayleigh."),
    (True, "<think>\nLight scatters.</think>\n\nBlue.", "\nLight scatters.", "Blue."),
    (False, "<think>Hmm.</think>Blue.", "Hmm.", "Blue."),
    (False, "Blue: </think> is text here.", "", "Blue: </think> is text here."),
    (True, "still thinking when the budget ran out", "still thinking when the budget ran out", ""),
    (True, "ends on a partial marker </thi", "ends on a partial marker </thi", ""),
    (False, "\n\nleading breaks <thin", "", "leading breaks <thin"),
]  # fmt: skip


@pytest.mark.parametrize(("forced", "raw", "reasoning", "content"), RAW)
def test_the_split_is_the_same_however_the_text_is_cut(
    forced: bool, raw: str, reasoning: str, content: str
) -> None:
    for cuts in [(), *((k,) for k in range(1, len(raw))), tuple(range(1, len(raw)))]:
        split = ReasoningSplit(forced)
        got = ["", ""]
        bounds = [0, *cuts, len(raw)]
        for a, b in zip(bounds, bounds[1:], strict=False):
            r, c = split.feed(raw[a:b])
            got[0] += r
            got[1] += c
        r, c = split.flush()
        assert (got[0] + r, got[1] + c) == (reasoning, content), cuts


def test_reasoning_tokens_count_up_to_the_end_marker() -> None:
    assert reasoning_token_count([5, 6, 99, 7, 8], 99, True) == 3
    assert reasoning_token_count([5, 6, 7], 99, True) == 3  # never ended: all reasoning
    assert reasoning_token_count([5, 99, 7], 99, False) == 0
    assert reasoning_token_count([5, 99, 7], None, True) == 0


def chunks(pieces: list[tuple[list[int], str]], cumulative: bool, finish: str | None) -> list[Any]:
    """SGLang's /generate stream of these (ids, text) pieces, incremental or cumulative."""
    out: list[Any] = []
    ids: list[int] = []
    text = ""
    for i, (new_ids, new_text) in enumerate(pieces):
        ids, text = ids + new_ids, text + new_text
        last = i == len(pieces) - 1
        meta = {"id": "r1", "completion_tokens": len(ids), "prompt_tokens": 4}
        meta["finish_reason"] = {"type": finish} if last and finish else None
        if cumulative:
            out.append({"text": text, "output_ids": list(ids), "meta_info": meta})
        else:
            out.append({"text": new_text, "output_ids": new_ids, "meta_info": meta})
    return out


PIECES = [([1, 2], "Light "), ([3, 99], "scatters</think>"), ([4, 5], "\n\nBlue"), ([6], ".")]


@pytest.mark.parametrize("cumulative", [False, True])
def test_both_stream_shapes_give_the_same_answer(cumulative: bool) -> None:
    drawn = Drawn(in_reasoning=True)
    counted: list[int] = []
    stream = GenerateStream(drawn, on_tokens=counted.append)
    for chunk in chunks(PIECES, cumulative, "stop"):
        assert not stream.feed(b"data: " + __import__("orjson").dumps(chunk))
    assert stream.feed(b"data: [DONE]")
    drawn.finish()
    assert list(drawn.ids) == [1, 2, 3, 99, 4, 5, 6]
    assert ("".join(drawn.reasoning), "".join(drawn.content)) == ("Light scatters", "Blue.")
    assert sum(counted) == 7 and stream.finish_reason == "stop"


def native(
    transports: tuple[ScriptedTransport, ScriptedTransport],
    detokenize: ScriptedTransport | None = None,
    chat: list[Answer] | None = None,
    kind: type[NativeClient] = NativeClient,
) -> NativeClient:
    """A client drawing by ids whose engine answers (tokenize, generate), `detokenize`, and
    on its chat endpoint `chat`."""
    endpoint = EngineClient(
        "http://127.0.0.1:1", model="m", transport=ScriptedTransport(chat or [])
    )
    return kind(
        "http://127.0.0.1:1",
        endpoint,
        reasoning_parser="qwen3",
        sampling_defaults=QWEN3,
        transports=(*transports, detokenize or ScriptedTransport([])),
    )


def test_an_answer_cut_mid_stream_goes_on_from_its_ids() -> None:
    prompt_ids = [151644, 872, 198, 151645]
    tokenize = ScriptedTransport(
        [Whole(200, {"tokens": prompt_ids, "count": 4}), Whole(200, {"tokens": [99], "count": 1})]
    )
    # first try: two chunks, then the engine dies; the next goes on and finishes
    held_back = [([1, 2], "Light "), ([3, 99], "catters</think>")]  # an "s" never streamed
    generate = ScriptedTransport(
        [
            Events([*chunks(held_back, False, None), CUT]),
            Events([*chunks(PIECES[2:], False, "stop"), b"[DONE]"]),
        ]
    )
    # The engine streams text a character at a time: the bytes of one cut between two tokens
    # wait for the next token, so what streamed before a cut may lack them. The answer's text
    # is decoded again from all of its ids.
    detokenize = ScriptedTransport([Whole(200, {"text": "Light scatters</think>\n\nBlue."})])
    client = native((tokenize, generate), detokenize)
    rec = record()
    drawn = client.drawing(rec, PARAMS)
    assert isinstance(drawn, Drawn)

    async def go() -> Any:
        with pytest.raises(AnswerInterrupted):
            await client.chat(rec, PARAMS, drawn=drawn)
        return await client.chat(rec, PARAMS, drawn=drawn)

    result = asyncio.run(go())
    first, second = generate.bodies
    assert first["input_ids"] == prompt_ids
    assert second["input_ids"] == prompt_ids + [1, 2, 3, 99]
    assert second["sampling_params"]["max_new_tokens"] == 100 - 4
    assert first["sampling_params"]["top_k"] == 20  # the checkpoint's default, as chat does
    assert len(tokenize.bodies) == 2  # rendered once; the marker's id asked once
    assert tokenize.bodies[0]["messages"] == rec.messages
    assert (result.reasoning, result.content) == ("Light scatters", "Blue.")
    assert result.finish_reason == "stop" and result.resumed_tokens == 4
    assert detokenize.bodies[0]["tokens"] == [1, 2, 3, 99, 4, 5, 6]
    assert (result.usage.completion_tokens, result.usage.reasoning_tokens) == (7, 4)
    assert result.usage.prompt_tokens == 4


def test_an_abort_keeps_the_drawn_ids_and_the_next_try_goes_on() -> None:
    tokenize = ScriptedTransport([Whole(200, {"tokens": [1]}), Whole(200, {"tokens": [99]})])
    aborted = chunks(PIECES[:1], False, "abort")
    generate = ScriptedTransport(
        [Events([*aborted, b"[DONE]"]), Events([*chunks(PIECES[1:], False, "length"), b"[DONE]"])]
    )
    detokenize = ScriptedTransport([Whole(200, {"text": "Light scatters</think>"})])
    client = native((tokenize, generate), detokenize)
    drawn = client.drawing(record(), PARAMS)
    assert isinstance(drawn, Drawn)

    async def go() -> Any:
        with pytest.raises(RequestFailed) as failed:
            await client.chat(record(), PARAMS, drawn=drawn)
        assert failed.value.kind == "abort"
        return await client.chat(record(), PARAMS, drawn=drawn)

    result = asyncio.run(go())
    assert generate.bodies[1]["input_ids"] == [1, 1, 2]
    assert result.finish_reason == "length" and result.resumed_tokens == 2


def test_thinking_off_is_all_content_and_the_switch_reaches_the_template() -> None:
    tokenize = ScriptedTransport([Whole(200, {"tokens": [1, 2]})])
    generate = ScriptedTransport([Events([*chunks([([7], "Blue.")], False, "stop"), b"[DONE]"])])
    client = native((tokenize, generate))
    params = PARAMS.model_copy(update={"thinking": False})
    drawn = client.drawing(record(), params)
    assert isinstance(drawn, Drawn) and not drawn.in_reasoning
    result = asyncio.run(client.chat(record(), params, drawn=drawn))
    assert tokenize.bodies[0]["chat_template_kwargs"] == {"enable_thinking": False}
    assert (result.reasoning, result.content, result.usage.reasoning_tokens) == (None, "Blue.", 0)


def test_a_switch_off_by_default_is_read_as_the_template_will() -> None:
    client = native((ScriptedTransport([]), ScriptedTransport([])))
    client.thinking = ThinkingSwitch("thinking", default=False)
    drawn = client.drawing(record(), PARAMS)
    assert isinstance(drawn, Drawn) and drawn.in_reasoning
    off = client.drawing(record(chat_template_kwargs={"thinking": False}), PARAMS)
    assert isinstance(off, Drawn) and not off.in_reasoning


def test_a_checkpointed_answer_goes_on_with_its_split_and_guard_window() -> None:
    drawn = Drawn(in_reasoning=True)
    drawn.add([1, 2, 3], "Light scat")
    drawn.add([4], "ters</th")  # a marker cut in two, held back
    again = Drawn.from_json(drawn.to_json())
    assert list(again.ids) == [1, 2, 3, 4]
    again.add([99, 5], "ink>\n\nBlue.")
    again.finish()
    assert ("".join(again.reasoning), "".join(again.content)) == ("Light scatters", "Blue.")


@pytest.mark.parametrize(
    ("drawn", "kept", "keep"),
    [
        (1, None, True),  # never kept: kept at once, a lost worker would cost it whole
        (63, None, True),
        (0, None, False),  # nothing drawn yet: nothing to keep
        (100, 100, False),  # nothing new
        (101, 100, True),  # anything new: what a lost worker costs is what was not kept
        (130, 100, True),
    ],
)
def test_which_answers_in_flight_the_next_checkpoint_keeps(
    drawn: int, kept: int | None, keep: bool
) -> None:
    assert worth_keeping(drawn, kept) is keep


@pytest.mark.parametrize(
    ("answers", "failures", "unrendered"),
    [
        ("", 0, False),
        ("x", 1, False),  # one server error: a blip
        ("xx", 2, False),
        ("xxx", 3, True),  # three in a row: the engine renders no prompt
        ("xx.x", 1, False),  # a rendered prompt between: the count starts again
        ("x.x.x.x", 1, False),
        ("xx.xxx", 3, True),
        ("xxx.", 0, True),  # for good: nothing rendered later takes it back
        ("xxxxx", 5, True),
    ],
)
def test_only_server_errors_in_a_row_say_the_engine_renders_no_prompt(
    answers: str, failures: int, unrendered: bool
) -> None:
    """`x`: /v1/tokenize answers a 5xx; `.`: it renders the prompt."""
    rendering = Rendering()
    said = []
    for answer in answers:
        if answer == "x":
            said.append(rendering.failed("engine answered 500: Integer exceeds 64-bit"))
        else:
            rendering.rendered()
    assert rendering.failures == failures
    assert (rendering.unrendered is not None) is unrendered
    assert said.count(True) == int(unrendered)  # said once, by the error that decided it
    if unrendered:
        assert "64-bit" in (rendering.unrendered or "")


CHAT_ANSWER = [
    {"id": "c1", "choices": [{"index": 0, "delta": {"content": "Blue."}}]},
    {"id": "c1", "choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]},
    b"[DONE]",
]
SERVER_ERROR = Whole(500, {"error": {"message": "Integer exceeds 64-bit"}})


def test_a_tokenize_server_error_fails_the_try_and_the_next_goes_on_by_ids() -> None:
    """One 5xx of /v1/tokenize (an engine restarting, overloaded) is a failed try of that
    answer, never an answer from another endpoint, and switches nothing off: the next try
    renders the prompt and draws it by ids."""
    answer = Events([*chunks(PIECES, False, "stop"), b"[DONE]"])
    tokenize = [SERVER_ERROR, Whole(200, {"tokens": [1, 2]}), Whole(200, {"tokens": [99]})]
    client = native((ScriptedTransport(tokenize), ScriptedTransport([answer])))
    drawn = client.drawing(record(), PARAMS)
    assert isinstance(drawn, Drawn)

    async def go() -> Any:
        with pytest.raises(RequestFailed) as failed:
            await client.chat(record(), PARAMS, drawn=drawn)
        assert failed.value.status == 500 and failed.value.tokens == 0
        assert client.refusal(record(), PARAMS) is None
        return await client.chat(record(), PARAMS, drawn=drawn)

    result = asyncio.run(go())
    assert (result.reasoning, result.content, result.finish_reason) == (
        "Light scatters",
        "Blue.",
        "stop",
    )
    assert drawn.prompt_ids == [1, 2] and client.rendering.failures == 0
    assert isinstance(client.drawing(record(), PARAMS), Drawn)


def fed(
    client: NativeClient,
    records: list[PromptRecord],
    drawn: dict[tuple[str, int], Drawn] | None = None,
) -> tuple[list[CompletionRecord], Feeder]:
    """The records a Feeder stores for `records` sent through `client` (no backoff)."""
    feeder = Feeder(lambda: client, FakeEngine(), 1, retries=5, backoff_s=lambda attempt: 0.0)
    results: dict[int, CompletionRecord] = {}
    future = feeder.run_batch("r", "b", records, PARAMS, results.__setitem__, drawn=drawn)
    try:
        future.result(timeout=30)
    finally:
        feeder.close()
    return [results[i] for i in range(len(records))], feeder


def test_an_answer_whose_render_failed_once_is_stored_as_drawn_by_ids() -> None:
    answer = Events([*chunks(PIECES, False, "stop"), b"[DONE]"])
    tokenize = [SERVER_ERROR, Whole(200, {"tokens": [1, 2]}), Whole(200, {"tokens": [99]})]
    client = native((ScriptedTransport(tokenize), ScriptedTransport([answer])))
    (stored,), feeder = fed(client, [record()])
    assert stored.error is None and (stored.reasoning, stored.content) == (
        "Light scatters",
        "Blue.",
    )
    assert stored.usage.prompt_tokens == 2 and stored.restarted is None
    assert feeder.failed_tries_total == 1
    assert client.rendering.unrendered is None


def test_an_engine_whose_tokenize_always_fails_is_fed_by_its_chat_endpoint_and_says_why() -> None:
    """SGLang 0.5.15 answers /v1/tokenize with a 500 for a checkpoint whose tokenizer sets no
    model_max_length: three in a row, and the answer goes through the chat endpoint (its
    template is the same), as does every later answer, each drawing refused with the reason;
    the try that found it out is not counted against the answer."""
    client = native(
        (ScriptedTransport([SERVER_ERROR] * 3), ScriptedTransport([])), chat=[Events(CHAT_ANSWER)]
    )
    (stored,), feeder = fed(client, [record()])
    assert stored.error is None and stored.content == "Blue." and stored.finish_reason == "stop"
    assert feeder.failed_tries_total == TOKENIZE_FAILURES_IN_A_ROW - 1
    later = client.drawing(record(), PARAMS)
    assert isinstance(later, str) and "/v1/tokenize failed 3 times in a row" in later


def test_an_answer_carried_in_starts_over_by_chat_and_says_what_that_cost() -> None:
    """Ids a checkpoint carried in, and an engine that renders no prompt: the answer starts
    over through the chat endpoint, and its record says why and how many tokens it lost."""
    client = native(
        (ScriptedTransport([SERVER_ERROR] * 3), ScriptedTransport([])), chat=[Events(CHAT_ANSWER)]
    )
    carried = Drawn(in_reasoning=True)
    carried.add([1, 2, 3], "Light scat")
    (stored,), _ = fed(client, [record()], {("p1", 0): carried})
    assert stored.error is None and stored.content == "Blue."
    assert stored.restarted is not None and stored.restarted["tokens"] == 3
    assert "/v1/tokenize failed" in stored.restarted["reason"]


class Counting(NativeClient):
    """A NativeClient that counts the `Drawn`s it makes."""

    made = 0

    def drawing(self, record: PromptRecord, params: GenerationParams) -> Drawn | str:
        way = super().drawing(record, params)
        self.made += isinstance(way, Drawn)
        return way


def test_an_answer_gets_one_drawn_however_often_it_is_asked_again() -> None:
    """Whether an answer is still drawn by ids is asked before each try (`refusal`); only
    the answer's first asking makes its `Drawn`."""
    aborted = Events([*chunks(PIECES[:1], False, "abort"), b"[DONE]"])
    rest = Events([*chunks(PIECES[1:], False, "stop"), b"[DONE]"])
    tokenize = ScriptedTransport([Whole(200, {"tokens": [1]}), Whole(200, {"tokens": [99]})])
    detokenize = ScriptedTransport([Whole(200, {"text": "Light scatters</think>\n\nBlue."})])
    client = native((tokenize, ScriptedTransport([aborted, rest])), detokenize, kind=Counting)
    assert isinstance(client, Counting)
    (stored,), _ = fed(client, [record()])
    assert stored.error is None and stored.resumed_tokens == 2
    assert client.made == 1


@pytest.mark.parametrize(
    ("kind", "info", "chosen", "parser", "splits"),
    [
        # a supervised engine runs the parser the worker started it with
        ("sglang", {"reasoning_parser": "deepseek-r1"}, "qwen3", "qwen3", True),
        ("emulator", {}, "qwen3", "qwen3", True),
        # an external engine runs what it was started with, whatever the worker would choose
        ("external", {**SGLANG_ARGS, "reasoning_parser": "qwen3"}, None, "qwen3", True),
        ("external", {**SGLANG_ARGS, "reasoning_parser": None}, "qwen3", None, True),
        ("external", {**SGLANG_ARGS, "reasoning_parser": "deepseek-v3"}, None, "deepseek-v3", True),
        # markers other than <think> … </think>: the chat endpoint's parser splits them
        ("external", {**SGLANG_ARGS, "reasoning_parser": "kimi_k2"}, "qwen3", "kimi_k2", False),
        ("external", {**SGLANG_ARGS, "reasoning_parser": "gpt-oss"}, None, "gpt-oss", False),
        ("sglang", {}, "glm45", "glm45", False),
        # an external engine with no /server_info: the worker's choice stands
        ("external", {}, "qwen3", "qwen3", True),
    ],
)
def test_which_reasoning_parser_an_answer_drawn_by_ids_is_split_by(
    kind: str, info: dict[str, Any], chosen: str | None, parser: str | None, splits: bool
) -> None:
    assert engine_reasoning_parser(kind, info, chosen) == parser
    assert splits_reasoning(parser) is splits
