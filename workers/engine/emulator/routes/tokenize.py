"""POST /v1/tokenize and /v1/detokenize (and /tokenize, /detokenize): SGLang's
serving_tokenize, with the emulator's tokenizer (`sim/tokenizer.py`).

Request (protocol.py TokenizeRequest): exactly one of `prompt` (a string or a list of strings)
and `messages` (a chat, rendered with the checkpoint's chat template, `add_generation_prompt`
on, `chat_template_kwargs` and `reasoning_effort` as template variables), plus `model`
(ignored: the one model is served), `tools`, `add_special_tokens` (default true; a prompt
only, and only where the checkpoint adds a BOS).
Response: `{"tokens": [ids], "count": n, "max_model_len": context length}`; a list of prompts
gives a list of id lists and a list of counts. Refusals are SGLang's 400s: a schema error
(type "Bad Request"), "Messages cannot be empty." or the template's own exception (type
"BadRequestError"). A rendered chat is remembered for the request log, so that a /generate of
its ids is logged as that chat (`request_log.py`).

Detokenize (DetokenizeRequest): `{"tokens": [ids] or [[ids], …], "skip_special_tokens": true}`
→ `{"text": str or [str, …]}`; with `skip_special_tokens` (the default) the tokens the
checkpoint marks special (`<|im_end|>`, …) are left out.
"""

from __future__ import annotations

from typing import Any

from aiohttp import web

from genfleet.workers.engine.emulator.routes.error_bodies import (
    ApiError,
    json_response,
    validation_error,
)
from genfleet.workers.engine.emulator.routes.validate import read_json
from genfleet.workers.engine.emulator.sim.stepper import Engine

SCHEMA = "TokenizeRequest"


def tokenize_body(body: dict[str, Any], engine: Engine) -> dict[str, Any]:
    """The answer to one tokenize request; raises ApiError as SGLang refuses."""
    prompt, messages = body.get("prompt"), body.get("messages")
    if (prompt is None) == (messages is None):
        raise validation_error(
            f"1 validation error for {SCHEMA}\n  Value error, Exactly one of 'prompt' or "
            "'messages' must be provided."
        )
    special = body.get("add_special_tokens", True)
    if not isinstance(special, bool):
        raise validation_error(
            f"1 validation error for {SCHEMA}\nadd_special_tokens\n"
            "  Input should be a valid boolean"
        )
    limit = engine.args.context_length
    tok = engine.tokenizer
    if messages is not None:
        ids = tok.encode(render(body, engine))
        engine.remember_rendering(ids, body)
        return {"tokens": ids, "count": len(ids), "max_model_len": limit}
    if isinstance(prompt, str):
        ids = tok.encode(prompt, special)
        return {"tokens": ids, "count": len(ids), "max_model_len": limit}
    if isinstance(prompt, list) and all(isinstance(p, str) for p in prompt):
        lists = [tok.encode(p, special) for p in prompt]
        return {"tokens": lists, "count": [len(i) for i in lists], "max_model_len": limit}
    raise validation_error(
        f"1 validation error for {SCHEMA}\nprompt\n  Input should be a valid string"
    )


def render(body: dict[str, Any], engine: Engine) -> str:
    """The prompt text of a request's `messages`, as SGLang's serving_chat renders it."""
    template = engine.template
    messages = template.prepare_messages(body.get("messages"))
    kwargs: dict[str, Any] = {}
    if body.get("reasoning_effort") is not None:
        kwargs["reasoning_effort"] = body["reasoning_effort"]
    extra = body.get("chat_template_kwargs")
    if extra is not None and not isinstance(extra, dict):
        raise validation_error(
            f"1 validation error for {SCHEMA}\nchat_template_kwargs\n"
            "  Input should be a valid dictionary"
        )
    kwargs.update(extra or {})
    tools = body.get("tools")
    return template.render(messages, kwargs, tools=tools if isinstance(tools, list) else None)


def detokenize_body(body: dict[str, Any], engine: Engine) -> dict[str, Any]:
    """The answer to one detokenize request; raises ApiError as SGLang refuses."""
    tokens, skip = body.get("tokens"), body.get("skip_special_tokens", True)
    if not isinstance(tokens, list) or not isinstance(skip, bool):
        raise validation_error(
            "1 validation error for DetokenizeRequest\ntokens\n  Input should be a valid list"
        )
    decode = engine.tokenizer.decode
    if not tokens:
        return {"text": ""}
    if all(_is_id(t) for t in tokens):
        return {"text": decode(tokens, skip)}
    if all(isinstance(one, list) for one in tokens):
        for one in tokens:
            if not all(_is_id(t) for t in one):
                raise ApiError(
                    400,
                    f"Invalid input: Sublist in 'tokens' must contain only integers. Found: {one}",
                )
        return {"text": [decode(one, skip) for one in tokens]}
    raise ApiError(400, "Invalid input: 'tokens' must be a list of integers.")


def _is_id(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


async def detokenize(request: web.Request) -> web.Response:
    """POST /v1/detokenize and /detokenize."""
    engine: Engine = request.app["engine"]
    try:
        body = await read_json(request, "DetokenizeRequest")
        return json_response(detokenize_body(body, engine))
    except ApiError as exc:
        return json_response(exc.body_a(), exc.status)


async def tokenize(request: web.Request) -> web.Response:
    """POST /v1/tokenize and /tokenize."""
    engine: Engine = request.app["engine"]
    try:
        body = await read_json(request, SCHEMA)
        return json_response(tokenize_body(body, engine))
    except ApiError as exc:
        return json_response(exc.body_a(), exc.status)
