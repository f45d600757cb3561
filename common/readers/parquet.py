"""Parquet files and directories of Parquet shards, read one record batch at a time.

Only the named columns are read (`--messages-col`, `--prompt-col`, `--id-col`; defaults
`messages` (or ShareGPT's `conversations`), `prompt`, `id`) and only one record batch of them
is in memory at a time, so a shard of any size streams. A row is numbered by its 0-based index
in its file (what `table.slice(row, 1)` or `df.iloc[row]` would show); rows without an id get
`{file}:{row}`, with the file's path relative to the source.

Rejects: a column named on the command line that a file lacks rejects that file (the mapping
the user asked for does not hold there, and guessing would mix datasets); a file with neither
a messages nor a prompt column is rejected as a whole; a bad value rejects its row. Other
files and rows go on. The row logic is shared with the Hugging Face reader (`hf_disk.py`),
whose `.arrow` files hold the same record batches.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import orjson

from genfleet.common.errors import ConfigError
from genfleet.common.readers.fields import (
    ROW_SYSTEM_FIELDS,
    BadRecord,
    Located,
    ReadAs,
    ReaderOptions,
    Reject,
    check_askable,
    check_id,
    check_messages,
    check_prompt,
    default_id_base,
    sharegpt_turns,
    split_answer,
    truncated,
    with_named_answer,
    with_row_system,
)
from genfleet.common.readers.s3source import SourcePath
from genfleet.common.readers.shapes import (
    CHAT,
    FIRST_TURN,
    PROMPT,
    SHAPES,
    SHAREGPT,
    Shape,
    read_as,
    read_shape,
)
from genfleet.common.records import PromptRecord

if TYPE_CHECKING:
    import pyarrow as pa

ROWS_PER_BATCH = 1024


def import_pyarrow() -> Any:
    """pyarrow, or a ConfigError with the install hint (it is the `formats` extra)."""
    try:
        import pyarrow
    except ImportError as exc:  # pragma: no cover - installed with genfleet[formats]
        raise ConfigError(
            "Parquet files and Hugging Face datasets (read or exported) need pyarrow: "
            "pip install 'genfleet[formats]' (or pip install pyarrow)"
        ) from exc
    return pyarrow


@dataclass(frozen=True, slots=True)
class Columns:
    """Which columns of one file carry the messages, the prompt and the id."""

    messages: str | None
    prompt: str | None
    id: str | None
    regenerate: bool = False  # --regenerate: a final assistant turn is the answer to replace
    id_named: bool = False  # --id-col: a null id is the row's reject, not the row number
    system: tuple[str, ...] = ()  # the row's own system prompt, beside its turns
    shape: Shape | None = None  # a published set's shape, read by its columns (shapes.py)
    shape_columns: tuple[str, ...] = ()  # those of its columns the file has
    system_col: str | None = None  # --system-col: the only system prompt, a null the reject
    answer_col: str | None = None  # --answer-col: the old answer, a null the row's reject

    def names(self) -> list[str]:
        named = (
            self.messages,
            self.prompt,
            self.id,
            *self.system,
            *self.shape_columns,
            self.system_col,
            self.answer_col,
        )
        return list(dict.fromkeys(name for name in named if name is not None))


def resolve_columns(name: str, present: Iterable[str], options: ReaderOptions) -> Columns | Reject:
    """The columns to read from a file with these column names, or the reject of the file."""
    available = set(present)
    for flag, column in (
        ("--messages-col", options.messages_col),
        ("--prompt-col", options.prompt_col),
        ("--id-col", options.id_col),
        ("--system-col", options.system_col),
        ("--answer-col", options.answer_col),
    ):
        if column is not None and column not in available:
            return Reject(name, None, column, f"no column {column!r} (named by {flag})")
    messages = options.messages_col or "messages"
    if (
        options.messages_col is None
        and "messages" not in available
        and "conversations" in available
    ):
        messages = "conversations"  # ShareGPT
    prompt = options.prompt_col or "prompt"
    # A column named by --messages-col or --prompt-col is the only one read.
    named = options.messages_col is not None or options.prompt_col is not None
    if named and options.messages_col is None:
        messages = ""
    if named and options.prompt_col is None:
        prompt = ""
    id_col = options.id_col or "id"
    columns = Columns(
        messages if messages in available else None,
        prompt if prompt in available else None,
        id_col if id_col in available else None,
        options.regenerate,
        id_named=options.id_col is not None,
        system=()
        if options.system_col
        else tuple(name for name in ROW_SYSTEM_FIELDS if name in available),
        system_col=options.system_col,
        answer_col=options.answer_col,
    )
    if columns.messages is None and columns.prompt is None:
        shape = None if named else _shape_of_columns(available, options.first_turn)
        if shape is not None:
            wanted = (shape.prompt, shape.extra, shape.answer or None)
            found = tuple(c for c in wanted if c is not None and c in available)
            return replace(columns, shape=shape, shape_columns=found)
        turns = " (MT-bench `turns`: --first-turn asks the first)" if "turns" in available else ""
        return Reject(
            name,
            None,
            messages or prompt,
            f"neither a {messages or 'messages'!r} nor a {prompt or 'prompt'!r} column nor a "
            f"known shape's (Alpaca, Dolly, OpenOrca, query/response); columns are "
            f"{sorted(available)}: name the prompt's with --prompt-col, a chat's with "
            f"--messages-col{turns}",
        )
    return columns


def file_read_as(name: str, columns: Columns, options: ReaderOptions) -> ReadAs:
    """How a file with these columns is read (said before its rows)."""
    if columns.shape is not None:
        shape = columns.shape.name
    elif options.messages_col or options.prompt_col:
        shape = "named columns"
    elif columns.messages is not None:
        shape = SHAREGPT if columns.messages == "conversations" else CHAT
    else:
        shape = PROMPT
    return read_as(name, shape, options)


def _shape_of_columns(available: set[str], first_turn: bool = False) -> Shape | None:
    """The shape whose columns a file holds (`shapes.SHAPES`, first match), with every column
    the shape reads present, so that each row has them all (null where a row lacks one);
    MT-bench's `turns` with `first_turn` (`--first-turn`)."""
    if first_turn and "turns" in available:
        return FIRST_TURN
    for shape in SHAPES:
        if shape.matches(dict.fromkeys(available)):
            return shape
    return None


def _clean_messages(value: Any) -> Any:
    """Drop keys whose value is null: an Arrow struct gives every message every field."""
    if isinstance(value, str):
        try:
            value = orjson.loads(value)  # messages stored as a JSON string column
        except orjson.JSONDecodeError:
            return value
    if isinstance(value, list):
        return [
            {k: v for k, v in message.items() if v is not None}
            if isinstance(message, dict)
            else message
            for message in value
        ]
    return value


def parse_row(row: dict[str, Any], columns: Columns, default_id: str) -> PromptRecord:
    """One row's values → a PromptRecord, or BadRecord naming the column."""
    record_id = default_id
    if columns.id is not None:
        if columns.id_named and row[columns.id] is None:
            raise BadRecord(columns.id, "is null (named by --id-col)")
        record_id = check_id(row[columns.id], columns.id) or default_id
    answer_field = columns.answer_col
    if columns.shape is not None:
        field = columns.shape.prompt
        answer_field = answer_field or columns.shape.answer or None
        messages = read_shape(row, columns.shape, with_answer=columns.answer_col is None).messages
    elif columns.messages is not None and row[columns.messages] is not None:
        field = columns.messages
        turns = sharegpt_turns(_clean_messages(row[field]), field)
        messages = check_messages(turns, field)
    elif columns.prompt is not None:
        field = columns.prompt
        messages = check_prompt(row[field], field)
    else:
        assert columns.messages is not None
        raise BadRecord(columns.messages, "is null")
    messages = with_row_system(row, messages, columns.system_col)
    messages = with_named_answer(row, messages, columns.answer_col)
    messages, previous = split_answer(messages, field, columns.regenerate, answer_field)
    return PromptRecord(record_id, check_askable(messages, field), previous=previous)


def rows_from_batches(
    name: str, base: str, batches: Iterable[pa.RecordBatch], columns: Columns, start: int = 0
) -> Iterator[Located]:
    """Records from record batches holding `columns`; rows are numbered from `start`."""
    row = start
    for batch in batches:
        values = {col: batch.column(col).to_pylist() for col in columns.names()}
        for i in range(batch.num_rows):
            data = {col: values[col][i] for col in values}
            try:
                yield (name, row, parse_row(data, columns, f"{base}:{row}"))
            except BadRecord as exc:
                yield Reject(name, row, exc.field, f"row {row}: {exc}")
            row += 1


def parquet_files(path: SourcePath) -> list[SourcePath]:
    """A file, or the Parquet shards of a directory in name order (shard order)."""
    if path.is_dir():
        return sorted([*path.glob("*.parquet"), *path.glob("*.pq")], key=str)
    return [path]


def read_parquet(path: SourcePath, options: ReaderOptions) -> Iterator[Located]:
    """Every row of every shard, in shard then row order, as records or rejects."""
    pa = import_pyarrow()
    import pyarrow.parquet as pq

    files = parquet_files(path)
    if not files:
        yield Reject(str(path), None, None, "no .parquet files in this directory")
    for file in files:
        name = str(file)
        try:
            # from S3: a seekable stream of ranged reads (footer, then row groups)
            handle = pq.ParquetFile(file if isinstance(file, Path) else file.open("rb"))
        except (pa.ArrowException, OSError) as exc:
            yield Reject(name, None, None, f"not a readable Parquet file: {exc}")
            continue
        with handle:
            columns = resolve_columns(name, handle.schema_arrow.names, options)
            if isinstance(columns, Reject):
                yield columns
                continue
            yield file_read_as(name, columns, options)
            base = default_id_base(file, path)
            yield from _row_groups(pa, handle, name, base, columns)


def _row_groups(pa: Any, handle: Any, name: str, base: str, columns: Columns) -> Iterator[Located]:
    """The file's rows, one row group at a time: a row group that cannot be read (corrupt
    pages) costs its own rows, reported with their count, and the next group is read. Row
    numbers come from the footer, so they stay the file's own after a lost group."""
    start = 0
    for group in range(handle.num_row_groups):
        size = handle.metadata.row_group(group).num_rows
        batches = handle.iter_batches(
            batch_size=ROWS_PER_BATCH, row_groups=[group], columns=columns.names()
        )
        rows_read = 0  # one item per row, record or reject
        try:
            for item in rows_from_batches(name, base, batches, columns, start=start):
                rows_read += 1
                yield item
        except (pa.ArrowException, OSError) as exc:
            reason = (
                f"Parquet row group {group} (rows {start}-{start + size - 1}) is corrupt: {exc}"
            )
            yield truncated(name, reason, rows_read, size)
        start += size
