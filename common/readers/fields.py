"""What every reader shares: the reject, the options, and the field checks of a record.

A format module (jsonl, parquet, hf_disk) yields `Located` items built with these checks; a
`BadRecord` raised by a check becomes a `Reject` naming the field.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from genfleet.common.readers.s3source import SourcePath
from genfleet.common.records import ROLES, PromptRecord


@dataclass(slots=True)
class Reject:
    """An input line that was refused, and exactly where and why.

    `truncated`: the file could not be read past this point (corrupt mid-file), so more than
    one line is lost: `rows_unread` says how many (None: the file does not say). The run
    records such a source as not read whole (`Manifest.sources_unread`).
    """

    file: str
    line: int | None
    field: str | None
    reason: str
    truncated: bool = False
    rows_unread: int | None = None

    def to_json(self) -> dict[str, Any]:
        data: dict[str, Any] = {
            "file": self.file,
            "line": self.line,
            "field": self.field,
            "reason": self.reason,
        }
        if self.truncated:
            data.update(truncated=True, rows_unread=self.rows_unread)
        return data

    def __str__(self) -> str:
        where = f"{self.file}:{self.line}" if self.line is not None else self.file
        field = f" [{self.field}]" if self.field else ""
        return f"{where}{field}: {self.reason}"


def truncated(file: str, reason: str, rows_read: int, rows_total: int | None) -> Reject:
    """The reject of a file that stopped being readable after `rows_read` rows."""
    unread = None if rows_total is None else max(rows_total - rows_read, 0)
    count = "an unknown number of" if unread is None else f"{unread} of {rows_total}"
    return Reject(
        file,
        None,
        None,
        f"{reason}; {count} rows were not read (the {rows_read} before were)",
        truncated=True,
        rows_unread=unread,
    )


@dataclass(frozen=True, slots=True)
class ReaderOptions:
    format: str | None = None  # None: from the path
    system_prompt: str | None = None
    limit: int | None = None
    samples: int = 1
    max_line_bytes: int = 8 * 1024 * 1024
    messages_col: str | None = None
    prompt_col: str | None = None
    id_col: str | None = None
    system_col: str | None = None  # the row's system prompt, instead of system/system_prompt
    answer_col: str | None = None  # the row's old answer, instead of its shape's own field
    first_turn: bool = False  # --first-turn: MT-bench-style `turns` read as their first turn
    # --regenerate: a conversation's final assistant turn is the old answer to replace (kept
    # as the record's `previous`, never sent); without it such a line is refused.
    regenerate: bool = False
    # where s3:// sources are read from: the store's endpoint and region
    s3_endpoint_url: str | None = None
    s3_region: str = "us-east-1"


@dataclass(frozen=True, slots=True)
class ReadAs:
    """How one file was read: its shape and where its prompt, system prompt, old answer and id
    came from. Readers yield one per file before its records; `read_source` hands them to the
    caller that asked (`enqueue` prints them), so a user sees what genfleet made of the file."""

    file: str
    shape: str
    prompt: str
    system: str
    answer: str
    id: str

    def __str__(self) -> str:
        return (
            f"{self.file}: read as {self.shape}: prompt {self.prompt}; system {self.system}; "
            f"old answer {self.answer}; id {self.id}"
        )


Item = PromptRecord | Reject
# What a format module yields: a record with the file and line (or row) it came from, a
# reject, or how a file is read (before its records).
Located = tuple[str, int, PromptRecord] | Reject | ReadAs


def default_id_base(file: SourcePath, source: SourcePath) -> str:
    """The first part of a default id `{base}:{line}`: the file's path relative to the source
    (its name when the source is the file), so that `part.0.jsonl:12` and `part.1.jsonl:12`
    of one folder never collide."""
    if isinstance(file, Path) and isinstance(source, Path):
        if source.is_dir() and source in file.parents:
            return file.relative_to(source).as_posix()
        return file.name
    folder = str(source).rstrip("/") + "/"  # in S3: the key below the source's prefix
    return str(file).removeprefix(folder) if str(file).startswith(folder) else file.name


class BadRecord(ValueError):
    """Raised by field checks; becomes a Reject naming `field`."""

    def __init__(self, field: str | None, reason: str) -> None:
        self.field = field
        super().__init__(reason)


def check_messages(value: Any, field: str = "messages") -> list[dict[str, Any]]:
    """Validate chat messages: a non-empty list of {role, content} with known roles."""
    if not isinstance(value, list):
        raise BadRecord(field, f"must be a list of messages, got {type(value).__name__}")
    if not value:
        raise BadRecord(field, "is empty")
    for i, message in enumerate(value):
        where = f"{field}[{i}]"
        if not isinstance(message, dict):
            raise BadRecord(where, f"must be an object, got {type(message).__name__}")
        role = message.get("role")
        if not isinstance(role, str):
            raise BadRecord(f"{where}.role", "is missing or not a string")
        if role not in ROLES:
            raise BadRecord(f"{where}.role", f"unknown role {role!r}")
        content = message.get("content")
        if isinstance(content, str):
            continue
        if isinstance(content, list) and content:
            continue
        if content is None and message.get("tool_calls"):
            continue
        raise BadRecord(f"{where}.content", "is missing, empty or not a string/parts list")
    return value


# ShareGPT speakers (`from`) and the chat role each one is.
SPEAKERS = {
    "human": "user",
    "user": "user",
    "gpt": "assistant",
    "assistant": "assistant",
    "model": "assistant",
    "system": "system",
}


def sharegpt_turns(value: Any, field: str) -> Any:
    """ShareGPT turns (`{"from": "human", "value": …}`) as chat messages; anything else as it
    is (check_messages judges it). A speaker outside SPEAKERS rejects the line, naming the turn
    and the value: guessing who spoke would train on the wrong side of a conversation."""
    if not isinstance(value, list) or not any(
        isinstance(turn, dict) and "from" in turn and "role" not in turn for turn in value
    ):
        return value
    messages: list[Any] = []
    for i, turn in enumerate(value):
        if not isinstance(turn, dict):
            raise BadRecord(f"{field}[{i}]", f"must be an object, got {type(turn).__name__}")
        speaker = turn.get("from")
        role = SPEAKERS.get(speaker) if isinstance(speaker, str) else None
        if role is None:
            known = ", ".join(SPEAKERS)
            raise BadRecord(f"{field}[{i}].from", f"unknown speaker {speaker!r} (known: {known})")
        text = turn.get("value")
        if not isinstance(text, str) or (not text.strip() and role != "assistant"):
            raise BadRecord(f"{field}[{i}].value", "is missing, empty or not a string")
        messages.append({"role": role, "content": text})
    return messages


# Where ShareGPT-style and OpenOrca-style sets keep the system prompt: beside the turns.
ROW_SYSTEM_FIELDS = ("system", "system_prompt")


def named_text(row: Mapping[str, Any], column: str, flag: str) -> str:
    """The string in a column named by `flag`: missing, null or not a string is the row's
    reject naming the column and the flag (another field or nothing in its place would mix two
    readings in one run)."""
    value = row.get(column)
    if value is None:
        said = "is null" if column in row else "is missing"
        raise BadRecord(column, f"{said} (named by {flag})")
    if not isinstance(value, str):
        raise BadRecord(column, f"must be a string, got {type(value).__name__} (named by {flag})")
    return value


def with_row_system(
    row: Mapping[str, Any], messages: list[Any], system_col: str | None = None
) -> list[Any]:
    """`messages` with the row's own system prompt first (`system` or `system_prompt` beside
    the conversation, or only the column `--system-col` names): part of the prompt, never
    dropped. An empty one adds nothing; one that differs from the conversation's own system
    turn, or from the other field, is the line's reject: which of the two is the system prompt
    is not for genfleet to guess."""
    if system_col is not None:
        found = [(system_col, named_text(row, system_col, "--system-col"))]
    else:
        found = [(key, row[key]) for key in ROW_SYSTEM_FIELDS if row.get(key) is not None]
    if not found:
        return messages
    key, value = found[0]
    for other, text in found:
        if not isinstance(text, str):
            raise BadRecord(other, f"must be a string, got {type(text).__name__}")
    if len(found) > 1 and found[1][1] != value and value.strip() and found[1][1].strip():
        raise BadRecord(found[1][0], f"differs from {key!r}: which one is the system prompt?")
    value = next((text for _, text in found if text.strip()), "")
    if not value.strip():
        return messages
    first = messages[0] if messages and isinstance(messages[0], dict) else {}
    if first.get("role") == "system":
        if first.get("content") == value:
            return messages
        raise BadRecord(
            key, "differs from the conversation's own system turn: which one is the system prompt?"
        )
    return [{"role": "system", "content": value}, *messages]


def with_named_answer(
    row: Mapping[str, Any], messages: list[Any], answer_col: str | None
) -> list[Any]:
    """`messages` with the old answer from the column `--answer-col` names as a final
    assistant turn (`split_answer` then keeps it as `previous` or refuses the line). A
    conversation that already ends with an assistant turn is the line's reject: which of the
    two is the old answer is not for genfleet to guess."""
    if answer_col is None:
        return messages
    answer = named_text(row, answer_col, "--answer-col")
    last = messages[-1] if messages and isinstance(messages[-1], dict) else {}
    if last.get("role") == "assistant":
        raise BadRecord(
            answer_col,
            "the conversation ends with an assistant turn too: which one is the old answer?",
        )
    return [*messages, {"role": "assistant", "content": answer}]


def check_askable(messages: list[dict[str, Any]], field: str) -> list[dict[str, Any]]:
    """`messages`, unless they hold only system turns: a model asked nothing answers anyway
    (an invented answer to no question), so such a line is its reject."""
    if all(message.get("role") == "system" for message in messages):
        raise BadRecord(field, "holds only a system turn: there is nothing to answer")
    return messages


REGENERATE_HINT = "ends with an assistant answer: pass --regenerate to replace it"


def split_think(text: str) -> tuple[str | None, str]:
    """(reasoning, content) of an answer that may hold a `<think>…</think>` block: the block
    is the reasoning, what follows it the content. A reasoning opened and never closed (an
    answer cut at its length cap) is all reasoning."""
    stripped = text.lstrip()
    if "</think>" in stripped:
        head, _, tail = stripped.partition("</think>")
        return head.removeprefix("<think>").strip(), tail.lstrip()
    if stripped.startswith("<think>"):
        return stripped.removeprefix("<think>").strip(), ""
    return None, text


def _text_of(content: Any) -> str | None:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = [part.get("text") for part in content if isinstance(part, dict)]
        return "".join(part for part in parts if isinstance(part, str))
    return None


def split_answer(
    messages: list[dict[str, Any]], field: str, regenerate: bool, answer_field: str | None = None
) -> tuple[list[dict[str, Any]], dict[str, str | None] | None]:
    """The messages the engine sees and the old answer they replace (`previous`).

    A conversation ending with an assistant turn is refused unless `regenerate`: sent as it
    is, the model would be asked to write a further turn after the answer it should replace.
    With `regenerate` that turn leaves the messages and becomes `{"content", "reasoning"}`
    (a `<think>` block or a `reasoning_content` field is the reasoning). Without a final
    assistant turn there is nothing to replace: the messages pass as they are.
    """
    last = messages[-1]
    if last.get("role") != "assistant":
        return messages, None
    # The old answer's own field where it has one (a shape's `output`, `response`).
    where = answer_field or f"{field}[-1]"
    if not regenerate:
        raise BadRecord(where, REGENERATE_HINT)
    content = _text_of(last.get("content"))
    if content is None:
        raise BadRecord(f"{where}.content", "the answer to replace is not text (a tool call?)")
    rest = messages[:-1]
    if not rest or all(m.get("role") == "system" for m in rest):
        raise BadRecord(where, "nothing is left to answer once the old answer is removed")
    if rest[-1].get("role") == "assistant":
        raise BadRecord(
            f"{field}[-2]", "is an assistant turn too: the conversation would still end with one"
        )
    reasoning, answer = split_think(content)
    stated = last.get("reasoning_content")
    if isinstance(stated, str) and stated.strip():
        reasoning = stated if reasoning is None else f"{stated}\n{reasoning}"
    return rest, {"content": answer, "reasoning": reasoning}


def check_prompt(value: Any, field: str = "prompt") -> list[dict[str, Any]]:
    if value is None:
        raise BadRecord(field, "is null")
    if not isinstance(value, str):
        raise BadRecord(field, f"must be a string, got {type(value).__name__}")
    if not value.strip():
        raise BadRecord(field, "is empty")
    return [{"role": "user", "content": value}]


def check_id(value: Any, field: str = "id") -> str | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, str | int):
        raise BadRecord(field, f"must be a string or integer, got {type(value).__name__}")
    text = str(value)
    if not text or len(text) > 512:
        raise BadRecord(field, "must be 1-512 characters")
    return text


# --- OpenAI Batch bodies ---------------------------------------------------------------------
# What genfleet owns and drops from a body: it always asks for one complete answer.
OWNED_FIELDS = frozenset({"model", "stream", "stream_options"})
# Fields a body may not carry because the answer to them could not be kept, and why.
REFUSED_FIELDS = {
    "tools": "tool calls are not kept in output records (only content and reasoning)",
    "tool_choice": "tool calls are not kept in output records (only content and reasoning)",
    "functions": "function calls are not kept in output records (only content and reasoning)",
    "function_call": "function calls are not kept in output records",
    "parallel_tool_calls": "tool calls are not kept in output records",
    "audio": "audio output is not supported",
    "modalities": "only text output is supported",
    "prediction": "predicted outputs are not supported",
    "web_search_options": "web search is not supported",
}
MAX_N = 128


def _number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def _integer(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _strings(value: Any) -> bool:
    return isinstance(value, str) or (
        isinstance(value, list) and all(isinstance(item, str) for item in value)
    )


def _response_format(value: Any) -> bool:
    if not isinstance(value, dict) or value.get("type") not in {
        "text",
        "json_object",
        "json_schema",
    }:
        return False
    if value["type"] != "json_schema":
        return True
    schema = value.get("json_schema")
    return (
        isinstance(schema, dict)
        and isinstance(schema.get("name"), str)
        and isinstance(schema.get("schema"), dict)
    )


# Fields passed to the engine as given, each with its check and what it must be.
BODY_FIELDS: dict[str, tuple[Any, str]] = {
    "max_tokens": (lambda v: _integer(v) and v >= 1, "a positive integer"),
    "max_completion_tokens": (lambda v: _integer(v) and v >= 1, "a positive integer"),
    "temperature": (_number, "a number"),
    "top_p": (_number, "a number"),
    "top_k": (_integer, "an integer"),
    "min_p": (_number, "a number"),
    "repetition_penalty": (_number, "a number"),
    "presence_penalty": (_number, "a number"),
    "frequency_penalty": (_number, "a number"),
    "seed": (_integer, "an integer"),
    "stop": (_strings, "a string or a list of strings"),
    "n": (lambda v: _integer(v) and 1 <= v <= MAX_N, f"an integer from 1 to {MAX_N}"),
    "response_format": (
        _response_format,
        'an object of type "text", "json_object" or "json_schema" (with json_schema.name '
        "and json_schema.schema)",
    ),
    "logprobs": (lambda v: isinstance(v, bool), "true or false"),
    "top_logprobs": (lambda v: _integer(v) and 0 <= v <= 20, "an integer from 0 to 20"),
    "logit_bias": (lambda v: isinstance(v, dict), "an object"),
    "chat_template_kwargs": (lambda v: isinstance(v, dict), "an object"),
    "reasoning_effort": (lambda v: isinstance(v, str), "a string"),
    "min_tokens": (lambda v: _integer(v) and v >= 0, "a non-negative integer"),
    "ignore_eos": (lambda v: isinstance(v, bool), "true or false"),
    "stop_token_ids": (
        lambda v: isinstance(v, list) and all(_integer(i) for i in v),
        "a list of integers",
    ),
    "skip_special_tokens": (lambda v: isinstance(v, bool), "true or false"),
    "regex": (lambda v: isinstance(v, str), "a string"),
    "ebnf": (lambda v: isinstance(v, str), "a string"),
    "user": (lambda v: isinstance(v, str), "a string"),
}


def check_body(body: dict[str, Any]) -> dict[str, Any]:
    """An OpenAI chat body's fields → the per-prompt parameters, passed to the engine as given.

    `messages` is checked apart; `model`, `stream` and `stream_options` are genfleet's and
    dropped; `max_completion_tokens` becomes `max_tokens`; `n` stays (the reader turns it into
    samples). Anything genfleet cannot honour, or does not know, is a BadRecord naming it.
    """
    params: dict[str, Any] = {}
    for name, value in body.items():
        if name == "messages" or name in OWNED_FIELDS or value is None:
            continue
        if name in REFUSED_FIELDS:
            raise BadRecord(f"body.{name}", f"not supported: {REFUSED_FIELDS[name]}")
        rule = BODY_FIELDS.get(name)
        if rule is None:
            raise BadRecord(
                f"body.{name}",
                "unknown field: genfleet passes only the fields it can honour (README: "
                "request fields)",
            )
        check, expected = rule
        if not check(value):
            raise BadRecord(f"body.{name}", f"must be {expected}")
        params[name] = value
    if "top_logprobs" in params and params.get("logprobs") is not True:
        raise BadRecord("body.top_logprobs", "needs logprobs: true")
    if "max_completion_tokens" in params:
        params["max_tokens"] = params.pop("max_completion_tokens")
    if params.get("n") == 1:
        del params["n"]
    return params
