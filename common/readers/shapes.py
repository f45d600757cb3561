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
MT-bench-style `turns` (a list of user turns, each asked after the answer to the one before)
are read with `--first-turn` only, as the first turn alone: a line is one request here, and a
later turn asked without the model's own answer before it would be another question. Without
the flag such a row is refused naming it.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from genfleet.common.readers.fields import BadRecord, ReadAs, ReaderOptions


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


# MT-bench-style `turns`, read with --first-turn: its first turn is the prompt, no old answer.
FIRST_TURN = Shape("MT-bench", "turns", None, "")


def shape_of(row: Mapping[str, Any], first_turn: bool = False) -> Shape | None:
    """The first shape whose fields `row` holds; MT-bench-style `turns` with `first_turn`
    (`--first-turn`), BadRecord naming that flag without it."""
    if "turns" in row and isinstance(row["turns"], list):
        if first_turn:
            return FIRST_TURN
        raise BadRecord(
            "turns",
            "MT-bench-style turns (each asked after the answer to the one before) are not "
            "asked turn by turn: --first-turn asks each row's first turn alone; for later "
            "turns give each its own line with the turns and answers before it as `messages`",
        )
    return next((shape for shape in SHAPES if shape.matches(row)), None)


def first_turn(row: Mapping[str, Any]) -> str:
    """The first of a row's `turns` (`--first-turn`), or BadRecord naming `turns[0]`."""
    turns = row["turns"]
    if not turns:
        raise BadRecord("turns", "is an empty list: no first turn to ask")
    value = turns[0]
    if not isinstance(value, str):
        raise BadRecord("turns[0]", f"must be a string, got {type(value).__name__}")
    if not value.strip():
        raise BadRecord("turns[0]", "is empty")
    return value


def read_shape(row: Mapping[str, Any], shape: Shape, with_answer: bool = True) -> Shaped:
    """The row's messages by `shape`: the user's prompt and, when the row holds a non-empty
    old answer (and `with_answer`: `--answer-col` names another field), that answer as a
    final assistant turn (`split_answer` decides what becomes of it); BadRecord naming the
    field otherwise."""
    if shape is FIRST_TURN:
        return Shaped(shape, [{"role": "user", "content": first_turn(row)}])
    prompt = _text(row, shape.prompt, required=True)
    if shape.extra is not None:
        extra = _text(row, shape.extra, required=False)
        if extra.strip():
            prompt = f"{prompt}\n\n{extra}"
    messages: list[dict[str, Any]] = [{"role": "user", "content": prompt}]
    answer = _text(row, shape.answer, required=False) if with_answer else ""
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


# --- One shape per file ----------------------------------------------------------------------
# Each shape a row can have, and what of it becomes the prompt, the system prompt and the old
# answer (README's table of shapes is checked against this one). The id is `id` in every
# shape but OpenAI Batch (`custom_id`), else `{file}:{line}`.
CHAT, SHAREGPT, PROMPT, OPENAI, TURNS = "chat", "ShareGPT", "prompt", "OpenAI Batch", "MT-bench"
ROW_SYSTEM = "`system` or `system_prompt`"
READINGS: dict[str, tuple[str, str, str]] = {
    CHAT: ("`messages`", f"a first `system` turn, or {ROW_SYSTEM}", "a final assistant turn"),
    SHAREGPT: (
        "`conversations` (`from`/`value`)",
        f"a first `system` turn, or {ROW_SYSTEM}",
        "a final `gpt` turn",
    ),
    PROMPT: ("`prompt`", ROW_SYSTEM, "none"),
    OPENAI: ("`body.messages`", "a first `system` turn", "a final assistant turn"),
    "Alpaca": ("`instruction`, then `input` when not empty", ROW_SYSTEM, "`output`"),
    "Dolly": ("`instruction`, then `context` when not empty", ROW_SYSTEM, "`response`"),
    "OpenOrca": ("`question`", ROW_SYSTEM, "`response`"),
    "query/response": ("`query`", ROW_SYSTEM, "`response`"),
    TURNS: ("the first of `turns`, with --first-turn (refused without)", ROW_SYSTEM, "none"),
}


def read_as(file: str, shape: str, options: ReaderOptions) -> ReadAs:
    """What `shape` (a READINGS key, several explicit ones joined by " + ", or a named
    column's reading) makes of `file`'s rows under `options`: a column named by a flag
    replaces the shape's own field."""
    parts = [READINGS.get(one, ("", ROW_SYSTEM, "a final assistant turn")) for one in _parts(shape)]
    prompt, system, answer = (" or ".join(dict.fromkeys(part)) for part in zip(*parts, strict=True))
    if options.prompt_col:
        prompt = f"`{options.prompt_col}` (--prompt-col)"
    elif options.messages_col:
        prompt = f"`{options.messages_col}` (--messages-col)"
    if options.system_col:
        system = f"`{options.system_col}` (--system-col)"
    if options.system_prompt:
        system += ", else --system-prompt"
    if options.answer_col:
        answer = f"`{options.answer_col}` (--answer-col)"
    if answer != "none":
        answer += " (kept with --regenerate)" if options.regenerate else " (needs --regenerate)"
    id_of = f"`{options.id_col}` (--id-col)" if options.id_col else id_reading(shape)
    if OPENAI in _parts(shape):
        id_of = id_reading(OPENAI) if shape == OPENAI else f"{id_reading(OPENAI)} or `id`"
    return ReadAs(file, shape, prompt, system, answer, id_of)


def id_reading(shape: str) -> str:
    """Where a row of `shape` takes its id (README's table of shapes says the same)."""
    return "`custom_id`" if shape == OPENAI else "`id`, else `{file}:{line}`"


def row_shape(row: Mapping[str, Any], options: ReaderOptions) -> str | None:
    """The shape one JSON row has (a READINGS key), or None for a row no shape reads (its
    own reject says what it holds). A column named by `--prompt-col`/`--messages-col` is read
    on every row: all rows have that one reading."""
    if options.format == "openai" or ("custom_id" in row and "body" in row):
        return OPENAI
    if options.messages_col or options.prompt_col:
        return "named columns"
    for field, shape in (("messages", CHAT), ("conversations", SHAREGPT), ("prompt", PROMPT)):
        if field in row:
            return shape
    if isinstance(row.get("turns"), list):
        return TURNS
    found = next((shape for shape in SHAPES if shape.matches(row)), None)
    return found.name if found is not None else None


# Lines that name their own reading (a chat, ShareGPT turns, a prompt, an OpenAI batch
# request) may share a file, as `examples/prompts.jsonl` mixes chat and prompt lines: each
# line says how it is read, nothing is guessed. A shape told by its field names (Alpaca,
# Dolly, …) is guessed, so it is the only shape of its file: a row of another shape among
# them is a row the guess does not fit.
EXPLICIT = frozenset({CHAT, SHAREGPT, PROMPT, OPENAI, "named columns"})


def _parts(shape: str) -> list[str]:
    return shape.split(" + ")


def file_shape(shapes: list[str]) -> str | None:
    """The shape a file whose rows have `shapes` (in order of appearance) is read as; None when
    they cannot share one file (`mixed_reason` says why)."""
    if not shapes:
        return None
    if len(shapes) == 1 or all(shape in EXPLICIT for shape in shapes):
        return " + ".join(shapes)
    return None


def fits(shape: str, file: str) -> bool:
    """Whether a row of `shape` belongs in a file read as `file`."""
    return shape in _parts(file) or (shape in EXPLICIT and all(p in EXPLICIT for p in _parts(file)))


# A JSON lines file's shape is decided on its first rows, held (decoded) while they are read:
# at most this many rows, or this many bytes of them, so memory stays bounded for any file.
PREFIX_ROWS = 1000
PREFIX_BYTES = 8 * 1024 * 1024  # decoded, a row takes a few times its bytes
SAMPLE_LINES = 5  # line numbers named per shape in a refusal


def mixed_reason(lines_of: Mapping[str, list[int]], element: bool = False) -> str:
    """Why a file of rows of several shapes is refused: each shape with its first lines, and
    what would read the file."""
    what = "elements" if element else "lines"
    parts = []
    for shape, numbers in lines_of.items():
        shown = ", ".join(map(str, numbers[:SAMPLE_LINES]))
        more = f", … ({len(numbers)} in all)" if len(numbers) > SAMPLE_LINES else ""
        parts.append(f"{shape} ({what} {shown}{more})")
    return (
        f"rows of more than one shape: {'; '.join(parts)}. A shape told by its field names "
        "is read alone in its file: "
        "split it into one file per shape, or name the fields every row is read from "
        "(--prompt-col or --messages-col, with --system-col, --answer-col, --id-col)"
    )


def mismatch_reason(shape: str, file_shape: str) -> str:
    """The reject of a row past the first rows whose shape is not the file's."""
    return (
        f"a {shape} row in a file read as {file_shape} (its first {PREFIX_ROWS} rows): a shape "
        "told by its field names is read alone in its file; split it into one file per "
        "shape, or name the fields every row is read from (--prompt-col or --messages-col)"
    )
