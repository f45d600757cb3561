"""`genfleet export`: a run's outputs as one file (JSONL, Parquet or OpenAI batch output).

Output objects are read one at a time in manifest order and written as they are read, so
memory is bounded by one batch (and one shard of the manifest) whatever the run size.
Records keep the input order: batches are in input order in the manifest and each output
object is in its batch's input order.

Deduplication by (id, sample) keeps a set for the current batch only. That is enough: the
reader rejects a repeated id, samples of an id are numbered 0..N-1, and batching puts every
prompt in exactly one batch, so a key can only repeat inside one output object (a retried
request or an overlapping checkpoint part merged into it).

Writes go to a temporary file that replaces the target only when complete (or is uploaded,
for `s3://bucket/key`), so a failed export never leaves half a file under the final name.
"""

from __future__ import annotations

import gzip
import hashlib
import io
import itertools
import os
import tempfile
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import IO, Any, Literal, Protocol
from urllib.parse import unquote, urlparse

import orjson

from genfleet.common import keys
from genfleet.common.errors import ConfigError, GenfleetError, StoreError
from genfleet.common.manifest import BatchEntry, Manifest
from genfleet.common.readers.parquet import import_pyarrow
from genfleet.common.records import batch_digest
from genfleet.common.settings import Settings
from genfleet.common.store import Store, new_temp_file, s3_client, store_of
from genfleet.common.waste import is_stopped
from genfleet.producer.tries import Tries, TryCounts

ExportFormat = Literal["jsonl", "parquet", "openai"]
FORMATS: tuple[str, ...] = ("jsonl", "parquet", "openai")


class RunIncomplete(GenfleetError):
    """Some batches of the run have no output yet; `--partial` exports the rest."""

    def __init__(self, run: str, missing: list[str], total: int) -> None:
        self.run = run
        self.missing = missing
        shown = ", ".join(missing[:10]) + (", ..." if len(missing) > 10 else "")
        super().__init__(
            f"run {run!r} is not finished: {len(missing)} of {total} batches have no output "
            f"({shown}); wait for them, `genfleet retry {run}`, or export with --partial"
        )


@dataclass
class ExportResult:
    run: str
    path: str
    format: str
    records: int = 0
    errors: int = 0
    duplicates: int = 0
    batches_total: int = 0
    batches_exported: int = 0
    missing_batches: list[str] = field(default_factory=list)
    shards: list[str] = field(default_factory=list)  # with --shard-size: the files, in order
    # The export rule's counts (`export_run`): rows cut at max_tokens (exported as they are),
    # rows the repetition guard stopped (exported; their loop's text only --with-stopped) and
    # how many of those had their text left out.
    cut: int = 0
    stopped: int = 0
    stopped_left_out: int = 0
    # Records given another try (`genfleet retry RUN --errors/--stopped/--cut`), those whose
    # row is now a retry's answer, and those of them that are kept answers.
    retried: int = 0
    retried_replaced: int = 0
    retried_kept: int = 0
    retries_pending: int = 0  # batches of retry rounds without output yet (originals stand)

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class RunScan:
    """The finished part of a run, read batch by batch in manifest order.

    `missing` holds the manifest's batches without an output object (including one that
    vanished between listing and reading); `duplicates` counts the records `records()`
    dropped. Both are final once `records()` is exhausted.
    """

    store: Store
    manifest: Manifest
    done: list[str]
    missing: list[str]
    duplicates: int = 0
    batches_read: int = 0

    def records(self) -> Iterator[dict[str, Any]]:
        run = self.manifest.run
        done = set(self.done)
        for entry in self.manifest.entries(self.store):  # one shard in memory at a time
            if entry.batch not in done:
                continue
            batch = entry.batch
            data = self.store.get(keys.output_key(run, batch))
            if data is None:
                self.missing.append(batch)
                self.missing.sort(key=keys.batch_index)
                continue
            self.batches_read += 1
            seen: set[tuple[Any, Any]] = set()
            rows: list[dict[str, Any]] = []
            for record in iter_output_lines(data):
                key = (record.get("id"), record.get("sample", 0))
                if key in seen:
                    self.duplicates += 1
                    continue
                seen.add(key)
                rows.append(record)
            check_output(run, entry, rows)
            yield from rows


class OutputMismatch(GenfleetError):
    """An output object does not answer the prompts the manifest says its batch holds."""


def check_output(run: str, entry: BatchEntry, rows: list[dict[str, Any]]) -> None:
    """Raise OutputMismatch unless `rows` answer the batch's staged prompts, one each, in
    order: the digests the rows name must make the batch digest the manifest recorded. Runs
    of an older genfleet recorded none and are not checked."""
    if not entry.sha256:
        return
    found = batch_digest(str(row.get("prompt_sha256")) for row in rows)
    if found != entry.sha256:
        raise OutputMismatch(
            f"run {run!r}: the output of {entry.batch} does not answer the prompts the "
            f"manifest staged for it ({len(rows)} records, {entry.prompts} prompts staged; "
            f"digest {found[:12]}, the manifest has {entry.sha256[:12]}): nothing exported. "
            f"Remove {keys.output_key(run, entry.batch)} and `genfleet retry {run}` to "
            f"generate it again"
        )


def iter_output_lines(data: bytes) -> Iterator[dict[str, Any]]:
    """Records of one gzip'd output object, decompressed line by line (no full copy)."""
    with gzip.GzipFile(fileobj=io.BytesIO(data)) as handle:
        for line in handle:
            if line.strip():
                yield orjson.loads(line)


def answers(scan: RunScan, counts: TryCounts) -> Iterator[dict[str, Any]]:
    """The run's standing answers, in input order: each record's newest accepted try
    (producer/tries.py), what `export` writes and `report` counts."""
    tries = Tries.load(scan.store, scan.manifest, scan_store)
    return tries.merge(scan.records(), counts)


def scan_run(settings: Settings, run: str) -> RunScan:
    """Open the run's store and split its manifest's batches into done and missing."""
    return scan_store(store_of(settings), run)


def scan_store(store: Store, run: str) -> RunScan:
    """Split the run's batches into done and missing, from the store's listing and the
    manifest's index (no shard is read until `records`)."""
    keys.validate_run(run)
    manifest = Manifest.load(store, run)
    if manifest is None:
        raise ConfigError(f"run {run!r} has no manifest in {store.url}: was it enqueued?")
    finished = {keys.batch_from_output_key(k) for k in store.list(keys.outputs_prefix(run))}
    batches = manifest.batch_ids()  # ids only: the entries are read as the outputs are
    done = [batch for batch in batches if batch in finished]
    missing = [batch for batch in batches if batch not in finished]
    return RunScan(store, manifest, done, missing)


class _Writer(Protocol):
    def write(self, record: dict[str, Any]) -> None: ...

    def close(self) -> None: ...


class _JsonlWriter:
    """One JSON object per line; gzip'd when the target name ends in `.gz`."""

    def __init__(self, path: Path, gz: bool) -> None:
        raw: IO[bytes] = path.open("wb")
        self._handle: IO[bytes] | gzip.GzipFile = (
            gzip.GzipFile(fileobj=raw, mode="wb", mtime=0) if gz else raw
        )
        self._raw = raw

    def write(self, record: dict[str, Any]) -> None:
        self._handle.write(orjson.dumps(record) + b"\n")

    def close(self) -> None:
        self._handle.close()
        self._raw.close()


class _OpenAIWriter(_JsonlWriter):
    def __init__(self, path: Path, gz: bool, created: int) -> None:
        super().__init__(path, gz)
        self._created = created

    def write(self, record: dict[str, Any]) -> None:
        super().write(openai_output_line(record, self._created))


def openai_output_line(record: dict[str, Any], created: int) -> dict[str, Any]:
    """One record as a line of an OpenAI Batch API output file (a BatchRequestOutput).

    Ids are derived from (run, id, sample), so exporting twice gives the same file. A
    completion is `response.status_code` 200 with a `chat.completion` body whose message
    carries `reasoning_content` (as SGLang and vLLM return it); an error record is
    `response: null` with `error: {code, message}`, the shape OpenAI uses for requests that
    produced no response: tools that check `error` before reading `response` handle both.
    """
    sample = record.get("sample", 0)
    seed = f"{record.get('run')}\0{record.get('id')}\0{sample}".encode()
    digest = hashlib.sha256(seed).hexdigest()[:32]
    line: dict[str, Any] = {
        "id": f"batch_req_{digest}",
        "custom_id": sample_custom_id(record.get("custom_id") or record.get("id"), sample),
        "response": None,
        "error": None,
    }
    error = record.get("error")
    if error:
        code = error.get("type") or "error"
        line["error"] = {"code": code, "message": error.get("message") or code}
        return line
    usage = record.get("usage") or {}
    prompt_tokens = int(usage.get("prompt_tokens") or 0)
    completion_tokens = int(usage.get("completion_tokens") or 0)
    message: dict[str, Any] = {"role": "assistant", "content": record.get("content")}
    if record.get("reasoning") is not None:
        message["reasoning_content"] = record["reasoning"]
    line["response"] = {
        "status_code": 200,
        "request_id": record.get("request_id") or f"req_{digest}",
        "body": {
            "id": f"chatcmpl-{digest}",
            "object": "chat.completion",
            "created": created,
            "model": record.get("model") or "",
            "choices": [
                {
                    "index": 0,
                    "message": message,
                    "logprobs": record.get("logprobs"),
                    "finish_reason": record.get("finish_reason"),
                }
            ],
            "usage": {
                "prompt_tokens": prompt_tokens,
                "completion_tokens": completion_tokens,
                "total_tokens": prompt_tokens + completion_tokens,
                "completion_tokens_details": {
                    "reasoning_tokens": int(usage.get("reasoning_tokens") or 0)
                },
            },
            "system_fingerprint": None,
        },
    }
    return line


def sample_custom_id(custom_id: Any, sample: int) -> str:
    """The `custom_id` of one sample's line: sample 0 keeps the request's own, sample k of it
    (`--samples`, or a body's `n`) is `<custom_id>-sample-<k>`, so every line of the file
    names one answer and a tool joining on custom_id never takes one answer for another."""
    return str(custom_id) if not sample else f"{custom_id}-sample-{sample}"


def parquet_schema(previous: bool = False) -> Any:
    """The fixed export schema: the JSONL record's fields, nested the same way.

    Messages are a list of {role, content, name, tool_call_id, tool_calls}, the shape chat
    trainers read; content that is not a string (parts lists) and tool_calls are JSON text.
    `engine` and `logprobs` (when asked for) are JSON text because their shapes vary.
    A `--regenerate` run's export adds `previous` {content, reasoning} (unless --no-previous).
    """
    import pyarrow as pa

    text = pa.string()
    message = pa.struct(
        [(name, text) for name in ("role", "content", "name", "tool_call_id", "tool_calls")]
    )
    usage = pa.struct(
        [(name, pa.int64()) for name in ("prompt_tokens", "completion_tokens", "reasoning_tokens")]
    )
    error = pa.struct([("type", text), ("message", text)])
    return pa.schema(
        [
            ("id", text),
            ("sample", pa.int32()),
            *[(name, text) for name in ("custom_id", "run", "batch")],
            ("messages", pa.list_(message)),
            *[(name, text) for name in ("reasoning", "content", "finish_reason")],
            ("usage", usage),
            ("model", text),
            ("engine", text),
            ("latency_s", pa.float64()),
            ("error", error),
            ("request_id", text),
            ("logprobs", text),
            ("try", pa.int32()),  # a retried record's round (null: the original answer)
            ("tried_in", text),
            *(
                [("previous", pa.struct([("content", text), ("reasoning", text)]))]
                if previous
                else []
            ),
        ]
    )


def _text(value: Any) -> str | None:
    if value is None or isinstance(value, str):
        return value
    return orjson.dumps(value).decode()


def _parquet_row(record: dict[str, Any]) -> dict[str, Any]:
    messages = [
        {
            "role": m.get("role"),
            "content": _text(m.get("content")),
            "name": m.get("name"),
            "tool_call_id": m.get("tool_call_id"),
            "tool_calls": _text(m.get("tool_calls")),
        }
        for m in record.get("messages") or []
    ]
    error = record.get("error")
    return {
        "id": str(record.get("id")),
        "sample": int(record.get("sample") or 0),
        "custom_id": record.get("custom_id"),
        "run": record.get("run"),
        "batch": record.get("batch"),
        "messages": messages,
        "reasoning": record.get("reasoning"),
        "content": record.get("content"),
        "finish_reason": record.get("finish_reason"),
        "usage": record.get("usage") or {},
        "model": record.get("model"),
        "engine": _text(record.get("engine")),
        "latency_s": float(record.get("latency_s") or 0.0),
        "error": {"type": error.get("type"), "message": error.get("message")} if error else None,
        "request_id": record.get("request_id"),
        "logprobs": _text(record.get("logprobs")),
        "try": record.get("try"),
        "tried_in": record.get("tried_in"),
        "previous": record.get("previous"),  # dropped by a schema without it
    }


class _ParquetWriter:
    """Rows buffered up to a row group (by count or by text size), then written."""

    ROW_GROUP_ROWS = 4096
    ROW_GROUP_BYTES = 32 * 1024 * 1024

    def __init__(self, path: Path, previous: bool = False) -> None:
        import pyarrow.parquet as pq

        self._schema = parquet_schema(previous)
        self._writer = pq.ParquetWriter(str(path), self._schema, compression="zstd")
        self._rows: list[dict[str, Any]] = []
        self._bytes = 0

    def write(self, record: dict[str, Any]) -> None:
        self._rows.append(_parquet_row(record))
        self._bytes += len(record.get("content") or "") + len(record.get("reasoning") or "")
        if len(self._rows) >= self.ROW_GROUP_ROWS or self._bytes >= self.ROW_GROUP_BYTES:
            self._flush()

    def _flush(self) -> None:
        if self._rows:
            import pyarrow as pa

            table = pa.Table.from_pylist(self._rows, schema=self._schema)
            self._writer.write_table(table)
            self._rows, self._bytes = [], 0

    def close(self) -> None:
        self._flush()
        self._writer.close()


def _writer(fmt: str, path: Path, gz: bool, manifest: Manifest, previous: bool) -> _Writer:
    if fmt == "jsonl":
        return _JsonlWriter(path, gz)
    if fmt == "openai":
        return _OpenAIWriter(path, gz, int(manifest.created_at))
    return _ParquetWriter(path, previous and bool(manifest.staging.get("regenerate")))


def _without_previous(records: Iterator[dict[str, Any]]) -> Iterator[dict[str, Any]]:
    for record in records:
        record.pop("previous", None)
        yield record


def _parse_out(out: str) -> tuple[str, Path | None]:
    """("s3", None) for s3://bucket/key, ("file", path) for a local path or file:// URL."""
    parsed = urlparse(out)
    if parsed.scheme == "s3":
        if not parsed.netloc or not parsed.path.strip("/") or out.endswith("/"):
            raise ConfigError(f"--out {out!r}: an S3 target is s3://bucket/key")
        return "s3", None
    if parsed.scheme == "file":
        return "file", Path(unquote(parsed.netloc + parsed.path))
    if parsed.scheme and len(parsed.scheme) > 1:
        raise ConfigError(f"--out {out!r}: use a local path, file:///path or s3://bucket/key")
    return "file", Path(out).expanduser()


def _create_temp(directory: Path) -> Path:
    """A new file beside the target (umask's mode); an unwritable folder names the fix."""
    try:
        directory.mkdir(parents=True, exist_ok=True)
        return new_temp_file(directory, ".genfleet-export-")
    except PermissionError as exc:
        raise ConfigError(
            f"cannot write the export into {directory}: permission denied for uid {os.getuid()} "
            f"(gid {os.getgid()}): make it writable for them; under docker compose the producer "
            "runs as HOST_UID:HOST_GID from .env: set them to DATA_DIR's owner (`id -u`, `id -g`)"
        ) from exc


def shard_name(out: str, index: int) -> str:
    """`dir/x.jsonl.gz` → `dir/x-00003.jsonl.gz`: the number goes before the name's suffixes."""
    head, sep, name = out.rpartition("/")
    stem, dot, suffixes = name.partition(".")
    return f"{head}{sep}{stem}-{index:05d}{dot}{suffixes}"


def export_run(
    settings: Settings,
    run: str,
    out: str,
    fmt: str = "jsonl",
    partial: bool = False,
    shard_size: int | None = None,
    previous: bool = True,
    with_stopped: bool = False,
) -> ExportResult:
    """Write every finished record of `run` to `out`, deduplicated, in input order.

    Raises RunIncomplete before writing anything when batches lack outputs, unless
    `partial`; then the finished batches are exported and the rest listed in the result.
    With `shard_size`, records go to numbered files (`shard_name`) of that many each.
    A `--regenerate` run's records keep their old answers (`previous`) unless `previous` is
    False (`--no-previous`).

    The export rule: every (id, sample) of a finished batch is one row, its standing answer
    (a retry's over the original: producer/tries.py). Error rows (`error` set, no text) and
    rows cut at max_tokens (`finish_reason "length"`, the text as generated) are exported as
    they are. A row the repetition guard stopped (`finish_reason "repetition"`) is exported
    with its `repetition` evidence and its `previous`, but without the loop's text
    (`content` and `reasoning` null) unless `with_stopped`: a loop is never an answer to
    train on by accident, and an old answer is never lost with it. Each kind is counted.
    """
    if fmt not in FORMATS:
        raise ConfigError(f"unknown export format {fmt!r}: use {', '.join(FORMATS)}")
    if fmt == "parquet":
        import_pyarrow()  # before anything is read: a clear error, not a traceback
    if shard_size is not None and shard_size < 1:
        raise ConfigError(f"--shard-size must be at least 1, got {shard_size}")
    _parse_out(out)
    scan = scan_run(settings, run)
    total = scan.manifest.batches_total
    if scan.missing and not partial:
        raise RunIncomplete(run, scan.missing, total)
    result = ExportResult(run=run, path=out, format=fmt, batches_total=total)
    counts = TryCounts()
    records = answers(scan, counts)
    if not previous:
        records = _without_previous(records)
    records = _export_rule(records, result, with_stopped)
    if shard_size is None:
        _write_target(settings, scan, partial, out, records, result, previous)
    else:
        for index in itertools.count():  # ends when the records do
            head = next(records, None)
            if head is None:
                break
            shard = itertools.chain([head], itertools.islice(records, shard_size - 1))
            result.shards.append(shard_name(out, index))
            _write_target(settings, scan, partial, result.shards[-1], shard, result, previous)
    result.duplicates = scan.duplicates
    result.retried, result.retried_replaced = counts.retried, counts.replaced
    result.retried_kept, result.retries_pending = counts.kept, counts.pending
    result.batches_exported = scan.batches_read
    result.missing_batches = list(scan.missing)
    return result


def _export_rule(
    records: Iterator[dict[str, Any]], result: ExportResult, with_stopped: bool
) -> Iterator[dict[str, Any]]:
    """Count cut and stopped rows; a stopped row loses its loop's text unless `with_stopped`
    (the row, its evidence and its `previous` stay)."""
    for record in records:
        if is_stopped(record):
            result.stopped += 1
            if not with_stopped:
                result.stopped_left_out += 1
                record = {**record, "content": None, "reasoning": None}
        elif not record.get("error") and record.get("finish_reason") == "length":
            result.cut += 1
        yield record


def _write_target(
    settings: Settings,
    scan: RunScan,
    partial: bool,
    out: str,
    records: Iterator[dict[str, Any]],
    result: ExportResult,
    previous: bool = True,
) -> None:
    """Write `records` to a temporary file, then move it to `out` (or upload it) complete."""
    _, local = _parse_out(out)
    tmp = _create_temp(local.parent if local is not None else Path(tempfile.gettempdir()))
    try:
        writer = _writer(result.format, tmp, out.endswith(".gz"), scan.manifest, previous)
        try:
            for record in records:
                writer.write(record)
                result.records += 1
                result.errors += bool(record.get("error"))
        finally:
            writer.close()
        if scan.missing and not partial:  # an output vanished while we read
            raise RunIncomplete(scan.manifest.run, scan.missing, scan.manifest.batches_total)
        if local is not None:
            os.replace(tmp, local)
        else:
            upload_file(settings, tmp, out)
    finally:
        tmp.unlink(missing_ok=True)


def upload_file(settings: Settings, path: Path, url: str) -> None:
    """Upload a finished export to s3://bucket/key (multipart for large files)."""
    from boto3.s3.transfer import TransferConfig
    from botocore.exceptions import BotoCoreError, ClientError

    parsed = urlparse(url)
    client = s3_client(settings.s3_endpoint_url, settings.s3_region)
    transfer = TransferConfig(multipart_threshold=64 * 1024 * 1024, max_concurrency=4)
    try:
        client.upload_file(str(path), parsed.netloc, parsed.path.lstrip("/"), Config=transfer)
    except (BotoCoreError, ClientError) as exc:
        raise StoreError(f"upload of the export to {url} failed: {exc}") from exc
