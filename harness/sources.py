"""Prompt sources a test writes (JSONL, Parquet, a dataset saved to disk) and what a reader
makes of one."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

import orjson

from genfleet.common.readers import Reject
from genfleet.common.records import PromptRecord

if TYPE_CHECKING:
    import pyarrow as pa


def write_prompts(
    path: Path, count: int, marked: dict[int, str] | None = None, prefix: str = "p"
) -> list[str]:
    """`count` short chat prompts; `marked[i]` replaces the i-th prompt's text. Returns ids."""
    ids = [f"{prefix}{i:05d}" for i in range(count)]
    with path.open("wb") as handle:
        for i, prompt_id in enumerate(ids):
            text = (marked or {}).get(i, f"Question {i}: what is {i} + {i}?")
            row = {"id": prompt_id, "messages": [{"role": "user", "content": text}]}
            handle.write(orjson.dumps(row) + b"\n")
    return ids


def write_prompt_lines(path: Path, prompts: list[str]) -> Path:
    """A JSONL file of `{"prompt": …}` lines (no ids), its folder made if need be."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(b"".join(orjson.dumps({"prompt": p}) + b"\n" for p in prompts))
    return path


def lines(path: Path, rows: list[Any]) -> Path:
    """A JSONL file of `rows` (bytes written as they are, anything else as JSON)."""
    path.write_bytes(
        b"".join((r if isinstance(r, bytes) else orjson.dumps(r)) + b"\n" for r in rows)
    )
    return path


def split(items: Any) -> tuple[list[PromptRecord], list[Reject]]:
    """A reader's output as (prompts, rejects)."""
    records: list[PromptRecord] = []
    rejects: list[Reject] = []
    for item in items:
        (rejects if isinstance(item, Reject) else records).append(item)
    return records, rejects


def save_dataset(directory: Path, tables: list[pa.Table], split: str = "train") -> Path:
    """The layout `Dataset.save_to_disk` writes: Arrow IPC streams + state + info."""
    import pyarrow as pa

    directory.mkdir(parents=True)
    names = [f"data-{i:05d}-of-{len(tables):05d}.arrow" for i in range(len(tables))]
    for name, table in zip(names, tables, strict=True):
        with pa.OSFile(str(directory / name), "wb") as sink:
            with pa.ipc.new_stream(sink, table.schema) as writer:
                for batch in table.to_batches(max_chunksize=2):
                    writer.write_batch(batch)
    state: dict[str, Any] = {
        "_data_files": [{"filename": n} for n in names],
        "_fingerprint": "0123456789abcdef",
        "_format_columns": None,
        "_format_kwargs": {},
        "_format_type": None,
        "_output_all_columns": False,
        "_split": split,
    }
    (directory / "state.json").write_bytes(orjson.dumps(state))
    (directory / "dataset_info.json").write_bytes(orjson.dumps({"features": {}, "splits": {}}))
    return directory


def corrupt_parquet(path: Path, rows: int, group_rows: int, bad_group: int) -> Path:
    """A Parquet file of `rows` prompts whose row group `bad_group` has its data pages
    overwritten (a file corrupt mid-file)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    table = pa.Table.from_pylist(
        [{"id": f"p{i:04d}", "prompt": f"question number {i} " * 5} for i in range(rows)]
    )
    pq.write_table(table, path, row_group_size=group_rows)
    data = bytearray(path.read_bytes())
    for column in range(2):
        offset = pq.ParquetFile(path).metadata.row_group(bad_group).column(column).data_page_offset
        data[offset : offset + 40] = b"\xff" * 40
    path.write_bytes(bytes(data))
    return path
