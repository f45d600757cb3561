"""Dataset readers: a source path in, PromptRecords and Rejects out, streaming, in input order.

A source is a local file or folder, or the same in S3 (`s3://bucket/key`, `s3://bucket/prefix/`).

Each format lives in its own module and yields `PromptRecord | Reject`; this module picks the
format from the path (or `--format`) and applies what every format shares: the system prompt,
`--samples`, `--limit` and duplicate-id detection (in bounded memory: `seen.SeenIds`). A
reject names the file, the line (or row), the field and the reason; the valid rest goes on.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

from genfleet.common.errors import InputError
from genfleet.common.readers.fields import Item, Located, ReadAs, ReaderOptions, Reject
from genfleet.common.readers.s3source import S3Path, SourcePath, s3_source
from genfleet.common.readers.seen import SeenIds
from genfleet.common.records import PromptRecord

__all__ = ["Item", "ReadAs", "ReaderOptions", "Reject", "detect_format", "read_source"]


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
    if name.endswith(
        (".jsonl", ".json", ".ndjson", ".jsonl.gz", ".jsonl.zst", ".json.gz", ".json.zst")
    ):
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


def read_source(
    source: str | Path, options: ReaderOptions | None = None, read_as: list[ReadAs] | None = None
) -> Iterator[Item]:
    """Every prompt of `source` (expanded to `samples`) and every reject, in input order;
    how each file was read (its shape) is appended to `read_as` when given."""
    options = options or ReaderOptions()
    path: SourcePath = Path(source)
    if str(source).startswith("s3://"):
        path = s3_source(str(source), options.s3_endpoint_url, options.s3_region)
    if not path.exists():
        raise InputError(f"{path}: no such file or directory")
    seen = SeenIds()
    taken = 0
    try:
        for chunk in _chunks(_format_items(path, options)):
            ids = [c[2].id for c in chunk if isinstance(c, tuple)]
            duplicate = iter(seen.check(ids))
            for located in chunk:
                if isinstance(located, ReadAs):
                    if read_as is not None:
                        read_as.append(located)
                    continue
                if isinstance(located, Reject):
                    yield located
                    continue
                file, line, item = located
                if next(duplicate):
                    yield Reject(file, line, "id", f"duplicate id {item.id!r}")
                    continue
                if options.limit is not None and taken >= options.limit:
                    return
                taken += 1
                if options.system_prompt and item.messages[0].get("role") != "system":
                    system = {"role": "system", "content": options.system_prompt}
                    item.messages = [system, *item.messages]
                yield from _samples(item, options.samples)
    finally:
        seen.close()


def _chunks(
    items: Iterator[Located], first: int = 64, most: int = 4096, wait_s: float = 0.05
) -> Iterator[list[Located]]:
    """`items` in lists, for the duplicate check to take ids a chunk at a time: small at
    first (the first batch goes out at once), then up to `most`, and cut whenever `wait_s`
    passed since its first item, so a slow source's prompts are not held back for a chunk."""
    size = first
    chunk: list[Located] = []
    started = 0.0
    for item in items:
        if not chunk:
            started = time.monotonic()
        chunk.append(item)
        if len(chunk) >= size or time.monotonic() - started >= wait_s:
            yield chunk
            chunk, size = [], min(size * 2, most)
    if chunk:
        yield chunk


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
