"""JSON lines: chat (`messages`), prompt (`prompt`) and OpenAI Batch API request lines.

Lines are read as bytes so that a line that is not UTF-8, not JSON, or over the size limit is
one reject, not the end of the file. OpenAI batch lines (`custom_id`, `method`, `url`, `body`)
carry per-line parameters that override the run's: every field of the body passes to the
engine as given, less what genfleet owns, and a field it cannot honour rejects the line
(`fields.check_body`).
"""

from __future__ import annotations

import gzip
from collections.abc import Iterator
from pathlib import Path
from typing import IO, Any

import orjson

from genfleet.common.readers.fields import (
    BadRecord,
    Located,
    ReaderOptions,
    Reject,
    check_body,
    check_id,
    check_messages,
    check_prompt,
    default_id_base,
)
from genfleet.common.readers.s3source import SourcePath
from genfleet.common.records import PromptRecord


def _open(path: SourcePath) -> IO[bytes]:
    if not path.name.endswith(".gz"):
        return path.open("rb")
    if isinstance(path, Path):
        return gzip.open(path, "rb")  # type: ignore[return-value]
    return gzip.GzipFile(fileobj=path.open("rb"), mode="rb")  # type: ignore[return-value]


def _files(path: SourcePath) -> list[SourcePath]:
    if path.is_dir():
        return sorted([*path.glob("*.jsonl"), *path.glob("*.jsonl.gz")], key=str)
    return [path]


def read_jsonl(path: SourcePath, options: ReaderOptions) -> Iterator[Located]:
    for file in _files(path):
        yield from _read_file(file, default_id_base(file, path), options)


def _lines(handle: IO[bytes], limit: int) -> Iterator[tuple[int, bytes | None]]:
    """(line number, bytes) per line, never holding more than `limit` bytes of one line: an
    oversized line comes as None (its rest is read and dropped in chunks)."""
    lineno = 0
    while True:
        raw = handle.readline(limit + 1)
        if not raw:
            return
        lineno += 1
        if len(raw) > limit and not raw.endswith(b"\n"):
            while True:  # skip to the end of this line
                rest = handle.readline(1 << 20)
                if not rest or rest.endswith(b"\n"):
                    break
            yield lineno, None
            continue
        yield lineno, raw


def _is_json_array(path: SourcePath) -> bool:
    """A `.json` file holding one JSON array of records (not JSON lines)."""
    if not path.name.lower().endswith(".json"):
        return False
    with _open(path) as handle:
        head = handle.read(4096).lstrip(b"\xef\xbb\xbf \t\r\n")
    return head.startswith(b"[")


def _read_array(path: SourcePath, base: str, options: ReaderOptions) -> Iterator[Located]:
    """Records of a JSON array file; the element number (from 1) stands for the line."""
    name = str(path)
    try:
        items = orjson.loads(path.read_bytes().removeprefix(b"\xef\xbb\xbf"))
    except orjson.JSONDecodeError as exc:
        yield Reject(name, None, None, f"not JSON: {exc}")
        return
    for number, data in enumerate(items, start=1):
        try:
            record = parse_line(data, default_id=f"{base}:{number}", fmt=options.format)
            yield (name, number, record)
        except BadRecord as exc:
            yield Reject(name, number, exc.field, f"element {number}: {exc}")


def _read_file(path: SourcePath, base: str, options: ReaderOptions) -> Iterator[Located]:
    """Every line of one file; `base` starts its default ids (see `default_id_base`)."""
    if _is_json_array(path):
        yield from _read_array(path, base, options)
        return
    name = str(path)
    with _open(path) as handle:
        for lineno, raw in _lines(handle, options.max_line_bytes):
            if raw is None:
                yield Reject(name, lineno, None, f"line over {options.max_line_bytes} bytes")
                continue
            if lineno == 1:
                raw = raw.removeprefix(b"\xef\xbb\xbf")  # a UTF-8 byte order mark
            if not raw.strip():
                continue
            try:
                text = raw.decode("utf-8")
            except UnicodeDecodeError as exc:
                yield Reject(name, lineno, None, f"not UTF-8 (byte {exc.start})")
                continue
            try:
                data = orjson.loads(text)
            except orjson.JSONDecodeError as exc:
                yield Reject(name, lineno, None, f"not JSON: {exc}")
                continue
            try:
                record = parse_line(data, default_id=f"{base}:{lineno}", fmt=options.format)
            except BadRecord as exc:
                yield Reject(name, lineno, exc.field, str(exc))
                continue
            yield (name, lineno, record)


def parse_line(data: Any, default_id: str, fmt: str | None = None) -> PromptRecord:
    """One decoded JSON line → a PromptRecord, or BadRecord naming the field."""
    if not isinstance(data, dict):
        raise BadRecord(None, f"must be a JSON object, got {type(data).__name__}")
    if fmt == "openai" or ("custom_id" in data and "body" in data):
        return _parse_openai(data)
    if fmt == "openai":
        raise BadRecord("custom_id", "an OpenAI batch line needs custom_id and body")
    record_id = check_id(data.get("id")) or default_id
    if "messages" in data:
        messages = check_messages(data["messages"])
    elif "prompt" in data:
        messages = check_prompt(data["prompt"])
    else:
        raise BadRecord("messages", "neither 'messages' nor 'prompt' is present")
    return PromptRecord(record_id, messages)


def _parse_openai(data: dict[str, Any]) -> PromptRecord:
    custom_id = check_id(data.get("custom_id"), "custom_id")
    if custom_id is None:
        raise BadRecord("custom_id", "is missing")
    method = data.get("method", "POST")
    if method != "POST":
        raise BadRecord("method", f"must be POST, got {method!r}")
    url = data.get("url", "/v1/chat/completions")
    if url != "/v1/chat/completions":
        raise BadRecord("url", f"only /v1/chat/completions is supported, got {url!r}")
    body = data.get("body")
    if not isinstance(body, dict):
        raise BadRecord("body", "is missing or not an object")
    messages = check_messages(body.get("messages"), "body.messages")
    params = check_body(body)
    return PromptRecord(custom_id, messages, 0, params or None, custom_id)
