"""What every reader shares: the reject, the options, and the field checks of a record.

A format module (jsonl, parquet, hf_disk) yields `Located` items built with these checks; a
`BadRecord` raised by a check becomes a `Reject` naming the field.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from genfleet.common.records import ROLES, PromptRecord


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
# What a format module yields: a record with the file and line (or row) it came from, or a
# reject.
Located = tuple[str, int, PromptRecord] | Reject


def default_id_base(file: Path, source: Path) -> str:
    """The first part of a default id `{base}:{line}`: the file's path relative to the source
    (its name when the source is the file), so that `part.0.jsonl:12` and `part.1.jsonl:12`
    of one folder never collide."""
    if source.is_dir() and source in file.parents:
        return file.relative_to(source).as_posix()
    return file.name


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
