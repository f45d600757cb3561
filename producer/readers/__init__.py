"""Dataset readers: a source path in, PromptRecords and Rejects out, streaming, in input order.

Each format lives in its own module and yields `PromptRecord | Reject`; this module picks the
format from the path (or `--format`) and applies what every format shares: the system prompt,
`--samples`, `--limit` and duplicate-id detection. A reject names the file, the line (or row),
the field and the reason; the valid rest goes on.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from common.errors import InputError
from common.records import ROLES, PromptRecord


@dataclass(slots=True)
class Reject:
    """An input line that was refused, and exactly where and why."""

    file: str
    line: int | None
    field: str | None
    reason: str

    def to_json(self) -> dict[str, Any]:
        return {"file": self.file, "line": self.line, "field": self.field, "reason": self.reason}

    def __str__(self) -> str:
        where = f"{self.file}:{self.line}" if self.line is not None else self.file
        field = f" [{self.field}]" if self.field else ""
        return f"{where}{field}: {self.reason}"


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


Item = PromptRecord | Reject
# What a format module yields: a record with the line (or row) it came from, or a reject.
Located = tuple[int, PromptRecord] | Reject


class BadRecord(ValueError):
    """Raised by field checks; becomes a Reject naming `field`."""

    def __init__(self, field: str | None, reason: str) -> None:
        self.field = field
        super().__init__(reason)


def detect_format(path: Path) -> str:
    """The format a path most likely holds; `--format` overrides it."""
    if path.is_dir():
        saved = ("dataset_info.json", "state.json", "dataset_dict.json")  # save_to_disk
        if any((path / name).exists() for name in saved):
            return "hf"
        if any(path.glob("*.parquet")):
            return "parquet"
        if any(path.glob("*.jsonl")) or any(path.glob("*.jsonl.gz")):
            return "jsonl"
        raise InputError(f"{path}: a directory, but neither a saved dataset nor parquet/jsonl")
    name = path.name.lower()
    if name.endswith((".parquet", ".pq")):
        return "parquet"
    if name.endswith((".jsonl", ".json", ".jsonl.gz", ".ndjson")):
        return "jsonl"  # the JSONL reader tells chat, prompt and OpenAI batch lines apart
    raise InputError(f"{path}: cannot tell the format from the name; pass --format")


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


def check_prompt(value: Any, field: str = "prompt") -> list[dict[str, Any]]:
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


def _format_items(path: Path, options: ReaderOptions) -> Iterator[Located]:
    fmt = options.format or detect_format(path)
    if fmt in {"jsonl", "chat", "prompt", "openai"}:
        from producer.readers.jsonl import read_jsonl

        return read_jsonl(path, options)
    if fmt == "parquet":
        from producer.readers.parquet import read_parquet

        return read_parquet(path, options)
    if fmt == "hf":
        from producer.readers.hf_disk import read_hf_disk

        return read_hf_disk(path, options)
    raise InputError(f"unknown format {fmt!r}: use jsonl, openai, parquet or hf")


def read_source(source: str | Path, options: ReaderOptions | None = None) -> Iterator[Item]:
    """Every prompt of `source` (expanded to `samples`) and every reject, in input order."""
    options = options or ReaderOptions()
    path = Path(source)
    if not path.exists():
        raise InputError(f"{path}: no such file or directory")
    seen: set[str] = set()
    taken = 0
    for located in _format_items(path, options):
        if isinstance(located, Reject):
            yield located
            continue
        line, item = located
        if item.id in seen:
            yield Reject(str(path), line, "id", f"duplicate id {item.id!r}")
            continue
        seen.add(item.id)
        if options.limit is not None and taken >= options.limit:
            return
        taken += 1
        if options.system_prompt and item.messages[0].get("role") != "system":
            item.messages = [{"role": "system", "content": options.system_prompt}, *item.messages]
        yield item
        for sample in range(1, options.samples):
            yield PromptRecord(item.id, item.messages, sample, item.params, item.custom_id)
