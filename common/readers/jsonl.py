"""JSON lines: chat (`messages`), ShareGPT (`conversations`), prompt (`prompt`) and OpenAI
Batch API request lines, plain, gzip'd (`.jsonl.gz`) or zstd'd (`.jsonl.zst`).

`--messages-col`, `--prompt-col` and `--id-col` name other fields (`--prompt-col question`);
a line that lacks a field named so is rejected naming it and the flag (a default id or another
field in its place would mix two mappings in one run). A messages field may hold chat messages
(`role`/`content`) or ShareGPT turns (`from`/`value`).

Lines are read as bytes so that a line that is not UTF-8, not JSON, or over the size limit is
one reject, not the end of the file. OpenAI batch lines (`custom_id`, `method`, `url`, `body`)
carry per-line parameters that override the run's: every field of the body passes to the
engine as given, less what genfleet owns, and a field it cannot honour rejects the line
(`fields.check_body`).
"""

from __future__ import annotations

import gzip
import io
import zlib
from collections.abc import Iterator
from itertools import chain
from typing import IO, Any, cast

import orjson

from genfleet.common.errors import ConfigError
from genfleet.common.readers.fields import (
    BadRecord,
    Located,
    ReaderOptions,
    Reject,
    check_askable,
    check_body,
    check_id,
    check_messages,
    check_prompt,
    default_id_base,
    sharegpt_turns,
    split_answer,
    with_named_answer,
    with_row_system,
)
from genfleet.common.readers.s3source import SourcePath
from genfleet.common.readers.shapes import (
    PREFIX_BYTES,
    PREFIX_ROWS,
    file_shape,
    fits,
    mismatch_reason,
    mixed_reason,
    read_as,
    read_shape,
    row_shape,
    shape_of,
)
from genfleet.common.records import PromptRecord

try:
    from zstandard import ZstdError as _ZstdError
except ImportError:  # pragma: no cover - a dependency of genfleet

    class _ZstdError(Exception):  # type: ignore[no-redef]
        """Stands in when zstandard is missing (reading a .zst then fails with a hint)."""


# The names of JSON lines files in a folder source.
PATTERNS = ("*.jsonl", "*.jsonl.gz", "*.jsonl.zst")


class _ZstdStream(io.RawIOBase):
    """A zstd file decompressed as it is read, every frame of it (the zstd CLI and pzstd
    write several). A stream that ends inside a frame raises: a cut file must never read as
    a shorter dataset (zstandard's own stream reader ends quietly there)."""

    CHUNK = 1 << 20

    def __init__(self, raw: IO[bytes], zstandard: Any) -> None:
        self._raw, self._zstd = raw, zstandard
        self._frame = zstandard.ZstdDecompressor().decompressobj()
        self._fed = False  # the current frame has input
        self._out = b""
        self._pos = 0  # how much of _out was read

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: Any) -> int:
        while self._pos >= len(self._out):
            chunk = self._raw.read(self.CHUNK)
            if not chunk:
                if self._fed and not self._frame.eof:
                    raise self._zstd.ZstdError("the file ends inside a zstd frame (truncated)")
                return 0
            self._out, self._pos = self._feed(chunk), 0
        size = min(len(buffer), len(self._out) - self._pos)
        buffer[:size] = memoryview(self._out)[self._pos : self._pos + size]
        self._pos += size
        return size

    def _feed(self, chunk: bytes) -> bytes:
        out = b""
        while chunk:
            self._fed = True
            out += self._frame.decompress(chunk)
            if not self._frame.eof:
                break
            chunk = self._frame.unused_data  # the next frame starts here
            self._frame = self._zstd.ZstdDecompressor().decompressobj()
            self._fed = False
        return out

    def close(self) -> None:
        self._raw.close()
        super().close()


def _zstd_reader(raw: IO[bytes]) -> IO[bytes]:
    """A zstd file read as lines."""
    try:
        import zstandard
    except ImportError as exc:  # pragma: no cover - a dependency of genfleet
        raise ConfigError(".jsonl.zst sources need zstandard: pip install zstandard") from exc
    return io.BufferedReader(_ZstdStream(raw, zstandard), buffer_size=_ZstdStream.CHUNK)


GZIP_MAGIC = b"\x1f\x8b"
ZSTD_MAGIC = b"\x28\xb5\x2f\xfd"


class _Gunzip(gzip.GzipFile):
    """gzip over a handle it owns: closing it closes the handle too (a GzipFile given a
    `fileobj` leaves it open)."""

    def __init__(self, raw: IO[bytes]) -> None:
        super().__init__(fileobj=raw, mode="rb")
        self._raw = raw

    def close(self) -> None:
        try:
            super().close()
        finally:
            self._raw.close()


def _peekable(handle: IO[bytes]) -> io.BufferedReader:
    """`handle` with `peek` (an S3 stream or a decompressor gets a buffer of its own)."""
    if isinstance(handle, io.BufferedReader):
        return handle
    return io.BufferedReader(cast(Any, handle))


def _open(path: SourcePath) -> IO[bytes]:
    """The file's bytes, decompressed: by its suffix (`.gz`, `.zst`), else by its first bytes
    (a file compressed without its suffix is read as what it is, not refused as "not UTF-8").
    One open, read front to back: an S3 object is still read in ranges, once."""
    raw = path.open("rb")
    name = path.name.lower()
    if name.endswith(".zst"):
        return _zstd_reader(raw)
    if name.endswith(".gz"):
        return cast(IO[bytes], _Gunzip(raw))
    handle = _peekable(raw)
    head = handle.peek(4)[:4]
    if head.startswith(GZIP_MAGIC):
        return cast(IO[bytes], _Gunzip(handle))
    if head.startswith(ZSTD_MAGIC):
        return _zstd_reader(handle)
    return handle


def _files(path: SourcePath) -> list[SourcePath]:
    if path.is_dir():
        return sorted([file for pattern in PATTERNS for file in path.glob(pattern)], key=str)
    return [path]


def read_jsonl(path: SourcePath, options: ReaderOptions) -> Iterator[Located]:
    folder = path.is_dir()  # an empty shard of a folder is no reject: the folder has others
    for file in _files(path):
        yield from _read_file(file, default_id_base(file, path), options, alone=not folder)


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


def _is_json_array(handle: io.BufferedReader) -> bool:
    """A file holding one JSON array of records (not JSON lines), whatever its suffix says
    (`.json`, or a `.jsonl` that is an array): a JSON line is an object, never an array."""
    head = bytes(handle.peek(4096)[:4096]).lstrip(b"\xef\xbb\xbf \t\r\n")
    return head.startswith(b"[")


def _read_array(
    name: str, handle: IO[bytes], base: str, options: ReaderOptions
) -> Iterator[Located]:
    """Records of a JSON array file (compressed or not); the element number (from 1) stands
    for the line. The array is in memory whole, so its shape is judged on every element."""
    try:
        items = orjson.loads(handle.read().removeprefix(b"\xef\xbb\xbf"))
    except orjson.JSONDecodeError as exc:
        yield Reject(name, None, None, f"a JSON array that is not valid JSON: {exc}")
        return
    numbered = list(enumerate(items, start=1))
    lines_of = _shapes(numbered, options)
    shape = file_shape(list(lines_of))
    if lines_of and shape is None:
        yield _refused(name, mixed_reason(lines_of, element=True), len(numbered))
        return
    if shape is not None:
        yield read_as(name, shape, options)
    for number, data in numbered:
        try:
            record = parse_line(data, f"{base}:{number}", options.format, options)
            yield (name, number, record)
        except BadRecord as exc:
            yield Reject(name, number, exc.field, f"element {number}: {exc}")


def _shapes(rows: list[tuple[int, Any]], options: ReaderOptions) -> dict[str, list[int]]:
    """The shapes of `rows` (decoded JSON; rejects are skipped), each with its line numbers,
    in the order they first appear."""
    lines_of: dict[str, list[int]] = {}
    for lineno, data in rows:
        shape = row_shape(data, options) if isinstance(data, dict) else None
        if shape is not None:
            lines_of.setdefault(shape, []).append(lineno)
    return lines_of


def _refused(name: str, reason: str, rows: int | None) -> Reject:
    """The reject of a whole file: recorded as a source not read (`sources_unread`)."""
    return Reject(name, None, None, reason, truncated=True, rows_unread=rows)


def _read_file(
    path: SourcePath, base: str, options: ReaderOptions, alone: bool = True
) -> Iterator[Located]:
    """Every line of one file; `base` starts its default ids (see `default_id_base`).

    The file is read as one shape (`shapes.row_shape`), decided on its first rows
    (`shapes.PREFIX_ROWS`, at most `PREFIX_BYTES`), which are held decoded until it is: rows
    of several shapes there refuse the file, naming the lines of each. Past them a row of
    another shape is its line's reject. Held this way, a file is read once, front to back,
    in bounded memory, and no record of a file that is then refused was handed on (the
    records already staged cannot be called back)."""
    name = str(path)
    try:
        with _open(path) as opened:
            handle = _peekable(opened)
            if _is_json_array(handle):
                yield from _read_array(name, handle, base, options)
                return
            yield from _read_lines(name, handle, base, options, alone)
    except (EOFError, OSError, zlib.error, _ZstdError) as exc:
        # Raised before the first line (a line's own reading ends in a Reject, `_decoded`).
        yield Reject(name, 1, None, f"compressed data is corrupt from here on: {exc}")


def _read_lines(
    name: str, handle: IO[bytes], base: str, options: ReaderOptions, alone: bool
) -> Iterator[Located]:
    rows = _decoded(name, handle, options)
    prefix: list[tuple[int, Any]] = []
    held_bytes = 0
    for lineno, data, size in rows:
        prefix.append((lineno, data))
        held_bytes += size
        if len(prefix) >= PREFIX_ROWS or held_bytes >= PREFIX_BYTES:
            break
    lines_of = _shapes(prefix, options)
    shape_read = file_shape(list(lines_of))
    if lines_of and shape_read is None:
        yield _refused(name, mixed_reason(lines_of), None)
        return
    if shape_read is not None:
        yield read_as(name, shape_read, options)
    read = 0
    for lineno, data in chain(prefix, ((n, d) for n, d, _ in rows)):
        read += 1
        if isinstance(data, Reject):
            yield data
            continue
        shape = row_shape(data, options) if isinstance(data, dict) else None
        if shape_read is None and shape is not None:
            shape_read = shape
            yield read_as(name, shape, options)
        elif shape is not None and shape_read is not None and not fits(shape, shape_read):
            yield Reject(name, lineno, None, mismatch_reason(shape, shape_read))
            continue
        yield _parsed(name, lineno, data, base, options)
    if not read and alone:
        yield Reject(name, None, None, "an empty file: no line to read")


def _decoded(
    name: str, handle: IO[bytes], options: ReaderOptions
) -> Iterator[tuple[int, Any, int]]:
    """(line number, decoded JSON or the line's Reject, bytes) per line that is not blank.
    Data that cannot be read on (corrupt compression) ends the file with a Reject from that
    line: the lines before it stand."""
    lineno = 0
    try:
        for lineno, raw in _lines(handle, options.max_line_bytes):
            data = _line_data(name, lineno, raw, options)
            if data is not None:
                yield lineno, data, len(raw or b"")
    except (EOFError, OSError, zlib.error, _ZstdError) as exc:
        reason = f"compressed data is corrupt from here on: {exc}"
        yield lineno + 1, Reject(name, lineno + 1, None, reason), 0


def _line_data(name: str, lineno: int, raw: bytes | None, options: ReaderOptions) -> Any:
    """One line decoded from JSON, or its Reject; None for a blank line."""
    if raw is None:
        return Reject(name, lineno, None, f"line over {options.max_line_bytes} bytes")
    if lineno == 1:
        raw = raw.removeprefix(b"\xef\xbb\xbf")  # a UTF-8 byte order mark
    if not raw.strip():
        return None
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        return Reject(name, lineno, None, f"not UTF-8 (byte {exc.start})")
    try:
        return orjson.loads(text)
    except orjson.JSONDecodeError as exc:
        return Reject(name, lineno, None, f"not JSON: {exc}")


def _parsed(name: str, lineno: int, data: Any, base: str, options: ReaderOptions) -> Located:
    """One decoded line as a record or its reject."""
    try:
        record = parse_line(data, f"{base}:{lineno}", options.format, options)
    except BadRecord as exc:
        return Reject(name, lineno, exc.field, str(exc))
    return (name, lineno, record)


def parse_line(
    data: Any, default_id: str, fmt: str | None = None, options: ReaderOptions | None = None
) -> PromptRecord:
    """One decoded JSON line → a PromptRecord, or BadRecord naming the field."""
    options = options or ReaderOptions()
    if not isinstance(data, dict):
        raise BadRecord(None, f"must be a JSON object, got {type(data).__name__}")
    if fmt == "openai" or ("custom_id" in data and "body" in data):
        return _parse_openai(data, options.regenerate)
    if fmt == "openai":
        raise BadRecord("custom_id", "an OpenAI batch line needs custom_id and body")
    id_field = options.id_col or "id"
    if options.id_col is not None and data.get(options.id_col) is None:
        # A named column is the record's id on every line: never the line number instead.
        said = "is null" if options.id_col in data else "is missing"
        raise BadRecord(options.id_col, f"{said} (named by --id-col)")
    record_id = check_id(data.get(id_field), id_field) or default_id
    answer_field = options.answer_col
    shape = None if _reads_a_conversation(data, options) else shape_of(data, options.first_turn)
    if shape is not None:
        field = shape.prompt
        messages = read_shape(data, shape, with_answer=answer_field is None).messages
        answer_field = answer_field or shape.answer or None
    else:
        field, messages = _conversation(data, options)
    messages = with_row_system(data, messages, options.system_col)
    messages = with_named_answer(data, messages, options.answer_col)
    messages, previous = split_answer(messages, field, options.regenerate, answer_field)
    return PromptRecord(record_id, check_askable(messages, field), previous=previous)


def _reads_a_conversation(data: dict[str, Any], options: ReaderOptions) -> bool:
    """Whether the row is read from a chat or prompt field (named by a flag, or one of the
    default names present) rather than by its shape (`shapes`)."""
    if options.messages_col or options.prompt_col:
        return True
    return any(name in data for name in ("messages", "conversations", "prompt"))


def _conversation(data: dict[str, Any], options: ReaderOptions) -> tuple[str, list[Any]]:
    """(field, messages) of a chat, ShareGPT or prompt line: the first field present that is
    not null (as in a Parquet row), or the first present one, whose check names the null.

    A column named by `--messages-col` or `--prompt-col` is the only one read: a row that
    also holds `messages` or `conversations` is not read from them instead."""
    if options.messages_col or options.prompt_col:
        chats = [options.messages_col] if options.messages_col else []
        prompt = options.prompt_col or ""
    else:
        chats, prompt = ["messages", "conversations"], "prompt"
    present = [name for name in (*chats, prompt) if name and name in data]
    if not present:
        if options.messages_col:
            raise BadRecord(options.messages_col, "is missing (named by --messages-col)")
        if options.prompt_col:
            raise BadRecord(options.prompt_col, "is missing (named by --prompt-col)")
        keys = ", ".join(sorted(map(str, data))[:12])
        raise BadRecord(
            "messages",
            f"neither 'messages', 'conversations', 'prompt' nor a known shape's fields "
            f"(Alpaca, Dolly, OpenOrca, query/response) are present; keys: {keys}. Name the "
            "prompt's field with --prompt-col, a chat's with --messages-col",
        )
    field = next((name for name in present if data[name] is not None), present[0])
    if field == prompt:
        return field, check_prompt(data[field], field)
    return field, check_messages(sharegpt_turns(data[field], field), field)


def _parse_openai(data: dict[str, Any], regenerate: bool) -> PromptRecord:
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
    messages, previous = split_answer(messages, "body.messages", regenerate)
    check_askable(messages, "body.messages")
    params = check_body(body)
    return PromptRecord(custom_id, messages, 0, params or None, custom_id, previous)
