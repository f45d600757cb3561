"""Dataset readers: a source path in, PromptRecords and Rejects out, streaming, in input order.

A source is a local file or folder, or the same in S3 (`s3://bucket/key`, `s3://bucket/prefix/`).

Each format lives in its own module and yields `PromptRecord | Reject`; this module picks the
format from the path (or `--format`) and applies what every format shares: the system prompt,
`--samples`, `--limit` and duplicate-id detection. A reject names the file, the line (or row),
the field and the reason; the valid rest goes on.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

from genfleet.common.errors import InputError
from genfleet.common.readers.fields import Item, Located, ReaderOptions, Reject
from genfleet.common.readers.s3source import S3Path, SourcePath, s3_source
from genfleet.common.records import PromptRecord

__all__ = ["Item", "ReaderOptions", "Reject", "detect_format", "read_source"]


def detect_format(path: SourcePath) -> str:
    """The format a path most likely holds; `--format` overrides it."""
    if path.is_dir():
        saved = ("dataset_info.json", "state.json", "dataset_dict.json")  # save_to_disk
        if any((path / name).exists() for name in saved):
            return "hf"
        if any(path.glob("*.parquet")):
            return "parquet"
        if any(any(path.glob(pattern)) for pattern in ("*.jsonl", "*.jsonl.gz", "*.jsonl.zst")):
            return "jsonl"
        raise InputError(f"{path}: a directory, but neither a saved dataset nor parquet/jsonl")
    name = path.name.lower()
    if name.endswith((".parquet", ".pq")):
        return "parquet"
    if name.endswith((".jsonl", ".json", ".jsonl.gz", ".jsonl.zst", ".ndjson")):
        return "jsonl"  # the JSONL reader tells chat, prompt and OpenAI batch lines apart
    raise InputError(f"{path}: cannot tell the format from the name; pass --format")


def _format_items(path: SourcePath, options: ReaderOptions) -> Iterator[Located]:
    fmt = options.format or detect_format(path)
    if fmt in {"jsonl", "chat", "prompt", "openai"}:
        from genfleet.common.readers.jsonl import read_jsonl

        return read_jsonl(path, options)
    if fmt == "parquet":
        from genfleet.common.readers.parquet import read_parquet

        return read_parquet(path, options)
    if fmt == "hf":
        from genfleet.common.readers.hf_disk import read_hf_disk

        if isinstance(path, S3Path):
            raise InputError(f"{path}: a dataset saved with save_to_disk is read from disk only")
        return read_hf_disk(path, options)
    raise InputError(f"unknown format {fmt!r}: use jsonl, openai, parquet or hf")


def read_source(source: str | Path, options: ReaderOptions | None = None) -> Iterator[Item]:
    """Every prompt of `source` (expanded to `samples`) and every reject, in input order."""
    options = options or ReaderOptions()
    path: SourcePath = Path(source)
    if str(source).startswith("s3://"):
        path = s3_source(str(source), options.s3_endpoint_url, options.s3_region)
    if not path.exists():
        raise InputError(f"{path}: no such file or directory")
    seen: set[str] = set()
    taken = 0
    for located in _format_items(path, options):
        if isinstance(located, Reject):
            yield located
            continue
        file, line, item = located
        if item.id in seen:
            yield Reject(file, line, "id", f"duplicate id {item.id!r}")
            continue
        seen.add(item.id)
        if options.limit is not None and taken >= options.limit:
            return
        taken += 1
        if options.system_prompt and item.messages[0].get("role") != "system":
            item.messages = [{"role": "system", "content": options.system_prompt}, *item.messages]
        yield from _samples(item, options.samples)


def _samples(item: PromptRecord, samples: int) -> Iterator[PromptRecord]:
    """`samples` records of `item` (its sample 0 first); a body's `n` multiplies them. With a
    `seed`, sample k is sent with seed + k (sample 0 keeps the seed as given), whether the
    copies come from `n` or `--samples`: with one seed for all, every answer would match."""
    params = dict(item.params or {})
    n = params.pop("n", 1)
    item.params = params or None
    yield item
    for sample in range(1, samples * n):
        own = item.params
        if isinstance(params.get("seed"), int):
            own = {**params, "seed": params["seed"] + sample}
        yield PromptRecord(item.id, item.messages, sample, own, item.custom_id, item.previous)
