"""The instruction-set shapes published training sets use, read by their field names.

A row without `messages`, `conversations` or `prompt` (and no column named by a flag) is read by
the first shape whose fields it holds (a Parquet file or HF dataset by its columns), so nothing
of its prompt is dropped and its old answer is kept. The prompt of a shape with a second field
joins the two with one blank line (Alpaca's
template without its preamble: the preamble is the set's, not the prompt's):

    Alpaca          instruction + input or output   prompt: instruction [+ input]
                                                    old answer: output
    Dolly           instruction + context or response
                                                    prompt: instruction [+ context]
                                                    old answer: response
    OpenOrca        question + response             prompt: question; system: system_prompt
                                                    old answer: response
    query/response  query + response                prompt: query; old answer: response

A row's `system` / `system_prompt` is its system prompt in every shape (`fields.with_row_system`).
MT-bench-style `turns` (a list of user turns, each asked after the answer to the one before) is
refused: a line is one request here.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from genfleet.common.readers.fields import BadRecord


@dataclass(frozen=True)
class Shape:
    """One published shape: its name, the fields that make the prompt (the second joined after
    a blank line when not empty), and the field of its old answer."""

    name: str
    prompt: str
    extra: str | None
    answer: str

    def matches(self, row: Mapping[str, Any]) -> bool:
        return self.prompt in row and (
            (self.extra is not None and self.extra in row) or self.answer in row
        )


SHAPES = (
    Shape("Alpaca", "instruction", "input", "output"),
    Shape("Dolly", "instruction", "context", "response"),
    Shape("OpenOrca", "question", None, "response"),
    Shape("query/response", "query", None, "response"),
)


@dataclass(frozen=True)
class Shaped:
    """A row read by its shape: the user's prompt, and the old answer where the row has one."""

    shape: Shape
    messages: list[dict[str, Any]]


def shape_of(row: Mapping[str, Any]) -> Shape | None:
    """The first shape whose fields `row` holds; BadRecord for MT-bench-style `turns`."""
    if "turns" in row and isinstance(row["turns"], list):
        raise BadRecord(
            "turns",
            "MT-bench-style turns (each asked after the answer to the one before) are not read: "
            "give each turn its own line with the answers before it as `messages`",
        )
    return next((shape for shape in SHAPES if shape.matches(row)), None)


def read_shape(row: Mapping[str, Any], shape: Shape) -> Shaped:
    """The row's messages by `shape`: the user's prompt and, when the row holds a non-empty
    old answer, that answer as a final assistant turn (`split_answer` decides what becomes of
    it); BadRecord naming the field otherwise."""
    prompt = _text(row, shape.prompt, required=True)
    if shape.extra is not None:
        extra = _text(row, shape.extra, required=False)
        if extra.strip():
            prompt = f"{prompt}\n\n{extra}"
    messages: list[dict[str, Any]] = [{"role": "user", "content": prompt}]
    answer = _text(row, shape.answer, required=False)
    if answer.strip():
        messages.append({"role": "assistant", "content": answer})
    return Shaped(shape, messages)


def _text(row: Mapping[str, Any], field: str, required: bool) -> str:
    value = row.get(field)
    if value is None:
        if required:
            raise BadRecord(field, "is missing" if field not in row else "is null")
        return ""
    if not isinstance(value, str):
        raise BadRecord(field, f"must be a string, got {type(value).__name__}")
    if required and not value.strip():
        raise BadRecord(field, "is empty")
    return value
