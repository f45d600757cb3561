"""The checkpoint's chat template, rendered as SGLang renders it for `/v1/tokenize` (§tokenize).

A local model directory's own template is used (`chat_template.jinja`, else `chat_template` in
`tokenizer_config.json`, where a list of named templates gives its `default`); with none, a
built-in one that renders plain chats the way Qwen3's does (thinking on: the prompt ends
`<|im_start|>assistant\\n`; `enable_thinking: false`: it adds `<think>\\n\\n</think>\\n\\n`).

Rendering follows transformers' `apply_chat_template` (utils/chat_template_utils.py): jinja2's
ImmutableSandboxedEnvironment with trim_blocks, lstrip_blocks, loop controls and the
`{% generation %}` tag; `raise_exception`, `strftime_now` and a `tojson` that does not escape
HTML; the checkpoint's special tokens (`bos_token`, `eos_token`, …) and the request's
`chat_template_kwargs` as template variables; `add_generation_prompt=True`. Messages are first
prepared as SGLang's serving_chat prepares them: a `None` content becomes "", keys whose value
is `None` are dropped, and a list of content parts becomes its text parts joined by a space
unless the template reads structured content (it mentions images, video, audio or vision).
"""

from __future__ import annotations

import json
import logging
from datetime import datetime
from pathlib import Path
from typing import Any

import jinja2
import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment

from genfleet.workers.engine.emulator.routes.error_bodies import ApiError, validation_error
from genfleet.workers.engine.emulator.sim.tokenizer import read_tokenizer_config, token_text

log = logging.getLogger("genfleet.workers.engine.emulator")

BUILT_IN = (
    "{%- for message in messages %}"
    "{%- set content = message.content if message.content is string else '' %}"
    "{{- '<|im_start|>' + message.role + '\\n' + content + '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}"
    "{{- '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false %}"
    "{{- '<think>\\n\\n</think>\\n\\n' }}"
    "{%- endif %}"
    "{%- endif %}"
)
MESSAGE_ROLES = ("system", "assistant", "tool", "function", "developer", "latest_reminder")
SPECIAL_TOKEN_KEYS = ("bos_token", "eos_token", "unk_token", "pad_token")
STRUCTURED_CONTENT_WORDS = ("image", "audio", "video", "vision")
SCHEMA = "TokenizeRequest"


class _Generation(jinja2.ext.Extension):
    """`{% generation %}…{% endgeneration %}` renders its body (transformers tracks assistant
    spans with it; the text is the same)."""

    tags = {"generation"}

    def parse(self, parser: Any) -> Any:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        call = self.call_method("_render", [], [])
        return jinja2.nodes.CallBlock(call, [], [], body).set_lineno(lineno)

    def _render(self, caller: Any) -> str:
        return str(caller())


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(
    value: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: Any = None,
    sort_keys: bool = False,
) -> str:
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def compile_template(source: str) -> jinja2.Template:
    """A template compiled in transformers' environment."""
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[_Generation, jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env.from_string(source)


class ChatTemplate:
    """One checkpoint's template and the special-token variables it renders with.

    Examples:
        template = ChatTemplate.from_checkpoint("/models/Qwen3-8B")
        text = template.render([{"role": "user", "content": "Hi"}], {"enable_thinking": False})
    """

    def __init__(self, source: str, origin: str, variables: dict[str, str] | None = None):
        self.source = source
        self.origin = origin  # a file path, or "built-in"
        self.variables = dict(variables or {})
        self.structured = any(word in source for word in STRUCTURED_CONTENT_WORDS)
        self._template = compile_template(source)

    @classmethod
    def from_checkpoint(cls, model_path: str) -> ChatTemplate:
        """The model directory's template; the built-in one when it has none (or no directory)."""
        config = read_tokenizer_config(model_path)
        variables = {
            key: text for key in SPECIAL_TOKEN_KEYS if (text := token_text(config.get(key)))
        }
        path = Path(model_path) / "chat_template.jinja"
        try:
            return cls(path.read_text(encoding="utf-8"), str(path), variables)
        except OSError:
            pass
        source = config_template(config.get("chat_template"))
        if source is not None:
            return cls(source, str(Path(model_path) / "tokenizer_config.json"), variables)
        return cls(BUILT_IN, "built-in", variables)

    def render(
        self,
        messages: list[dict[str, Any]],
        kwargs: dict[str, Any] | None = None,
        *,
        tools: Any = None,
        add_generation_prompt: bool = True,
    ) -> str:
        """The prompt text of already prepared messages (`prepare_messages`); a template's
        `raise_exception` (or a TypeError in it) is a 400, as in SGLang's serving_chat."""
        context = {**self.variables, **(kwargs or {})}
        try:
            return self._template.render(
                messages=messages,
                tools=tools,
                documents=None,
                add_generation_prompt=add_generation_prompt,
                **context,
            )
        except (jinja2.TemplateError, TypeError) as exc:
            raise ApiError(400, str(exc)) from exc

    def prepare_messages(self, messages: Any) -> list[dict[str, Any]]:
        """Validate messages as SGLang's ChatCompletionMessageParam does and shape them for
        the template (see the module docstring); refusals are SGLang's 400s."""
        if not isinstance(messages, list):
            raise validation_error(
                f"1 validation error for {SCHEMA}\nmessages\n  Input should be a valid list"
            )
        if not messages:
            raise ApiError(400, "Messages cannot be empty.")
        return [self._prepare(i, message) for i, message in enumerate(messages)]

    def _prepare(self, i: int, message: Any) -> dict[str, Any]:
        if not isinstance(message, dict):
            raise _message_error(i, "Input should be a valid dictionary")
        role = message.get("role")
        if not isinstance(role, str):
            detail = "role\n  Field required" if role is None else "'role' must be a string"
            raise _message_error(i, detail)
        if role != "user":
            if role.lower() not in MESSAGE_ROLES:
                allowed = ", ".join(repr(r) for r in MESSAGE_ROLES)
                raise _message_error(i, f"'role' must be one of {allowed} (case-insensitive).")
            role = role.lower()
        content = message.get("content")
        if role == "user" and content is None:
            raise _message_error(i, "content\n  Field required")
        if content is not None and not isinstance(content, str | list):
            raise _message_error(i, "content\n  Input should be a valid string")
        prepared = {k: v for k, v in message.items() if v is not None}
        prepared["role"] = role
        prepared["content"] = self._content(i, content)
        return prepared

    def _content(self, i: int, content: str | list[Any] | None) -> str | list[dict[str, Any]]:
        if content is None:
            return ""
        if isinstance(content, str):
            return content
        parts: list[dict[str, Any]] = []
        for part in content:
            if not isinstance(part, dict) or not isinstance(part.get("type"), str):
                raise _message_error(i, "content\n  Input should be a valid list of content parts")
            kind = part["type"]
            if kind in ("text", "input_text"):
                if not isinstance(part.get("text"), str):
                    raise _message_error(i, "content.text\n  Field required")
                parts.append({"type": "text", "text": part["text"]})
            elif kind in ("image_url", "input_image"):
                parts.append({"type": "image"})
            elif kind in ("video_url", "audio_url"):
                parts.append({"type": kind.removesuffix("_url")})
        if self.structured:
            return parts
        return " ".join(p["text"] for p in parts if p["type"] == "text")


def _message_error(i: int, detail: str) -> ApiError:
    return validation_error(f"1 validation error for {SCHEMA}\nmessages.{i}\n  {detail}")


def config_template(value: Any) -> str | None:
    """tokenizer_config.json's `chat_template`: a string, or a list of named templates of
    which the `default` one (else the first) is used."""
    if isinstance(value, str):
        return value
    if isinstance(value, list):
        named = {t.get("name"): t.get("template") for t in value if isinstance(t, dict)}
        chosen = named.get("default") or next(iter(named.values()), None)
        return chosen if isinstance(chosen, str) else None
    return None
