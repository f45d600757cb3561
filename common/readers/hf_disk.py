"""A Hugging Face dataset saved with `save_to_disk`, read without the `datasets` package.

A saved `Dataset` is a directory of `data-NNNNN-of-NNNNN.arrow` files (Arrow IPC streams, one
record batch at a time, so memory stays bounded), listed in order by `state.json`
(`_data_files`), with the features in `dataset_info.json`. `save_to_disk` flattens any
indices mapping (select, shuffle) before writing, so the data files are the rows in order.

A saved `DatasetDict` has `dataset_dict.json` (`{"splits": [...]}`) and one such directory per
split: genfleet reads the `train` split, or the first split listed when there is no `train`.
To read another split, point at its directory (`SAVED/test`). Rows are numbered by their
0-based index in the split (what `dataset[row]` shows); rows without an id get
`{split}:{row}`, where the split is the saved directory's name. Columns follow the Parquet
reader (`--messages-col`, `--prompt-col`, `--id-col`).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import orjson

from genfleet.common.readers.fields import Located, ReaderOptions, Reject, truncated
from genfleet.common.readers.parquet import (
    file_read_as,
    import_pyarrow,
    resolve_columns,
    rows_from_batches,
)


def dataset_dir(path: Path) -> Path | Reject:
    """The saved Dataset to read: `path` itself, or the chosen split of a DatasetDict."""
    dict_file = path / "dataset_dict.json"
    if not dict_file.exists():
        return path
    try:
        splits = orjson.loads(dict_file.read_bytes()).get("splits") or []
    except (orjson.JSONDecodeError, AttributeError) as exc:
        return Reject(str(dict_file), None, "splits", f"not a dataset_dict.json: {exc}")
    if not isinstance(splits, list) or not splits:
        return Reject(str(dict_file), None, "splits", "lists no splits")
    split = "train" if "train" in splits else str(splits[0])
    return path / split


def data_files(directory: Path) -> list[Path] | Reject:
    """The Arrow files of a saved Dataset, in the order `state.json` gives them."""
    state_file = directory / "state.json"
    if state_file.exists():
        try:
            state = orjson.loads(state_file.read_bytes())
            names = [entry["filename"] for entry in state["_data_files"]]
        except (orjson.JSONDecodeError, KeyError, TypeError) as exc:
            return Reject(str(state_file), None, "_data_files", f"not a readable state.json: {exc}")
        return [directory / name for name in names]
    files = sorted(directory.glob("data-*.arrow"))
    if not files:
        return Reject(str(directory), None, None, "no state.json and no data-*.arrow files")
    return files


def _open_batches(pa: Any, file: Path) -> Iterator[Any]:
    """Record batches of one data file: an IPC stream, or an IPC file (older saves)."""
    source = pa.memory_map(str(file), "r")
    try:
        yield from pa.ipc.open_stream(source)
        return
    except pa.ArrowInvalid:
        source.seek(0)
    reader = pa.ipc.open_file(source)
    for i in range(reader.num_record_batches):
        yield reader.get_batch(i)


def _all_batches(pa: Any, files: list[Path], names: list[str]) -> Iterator[Any]:
    for file in files:
        for batch in _open_batches(pa, file):
            yield batch.select(names)


def _schema_names(pa: Any, file: Path) -> list[str]:
    source = pa.memory_map(str(file), "r")
    try:
        return list(pa.ipc.open_stream(source).schema.names)
    except pa.ArrowInvalid:
        source.seek(0)
        return list(pa.ipc.open_file(source).schema.names)


def read_hf_disk(path: Path, options: ReaderOptions) -> Iterator[Located]:
    """Every row of the saved dataset (or of its chosen split), in order."""
    pa = import_pyarrow()
    directory = dataset_dir(path)
    if isinstance(directory, Reject):
        yield directory
        return
    files = data_files(directory)
    if isinstance(files, Reject):
        yield files
        return
    name = str(directory)
    try:
        present = _schema_names(pa, files[0]) if files else []
    except (pa.ArrowException, OSError) as exc:
        yield Reject(str(files[0]), None, None, f"not a readable Arrow file: {exc}")
        return
    columns = resolve_columns(name, present, options)
    if isinstance(columns, Reject):
        yield columns
        return
    yield file_read_as(name, columns, options)
    batches = _all_batches(pa, files, columns.names())
    rows_read = 0  # one item per row, record or reject
    try:
        for item in rows_from_batches(name, directory.resolve().name, batches, columns):
            rows_read += 1
            yield item
    except (pa.ArrowException, OSError) as exc:
        # Later rows could not be numbered reliably: stop this dataset, keep what was read.
        reason = f"unreadable Arrow data after some rows: {exc}"
        yield truncated(name, reason, rows_read, _expected_rows(directory))


def _expected_rows(directory: Path) -> int | None:
    """The split's row count as `dataset_info.json` records it, when it does."""
    try:
        info = orjson.loads((directory / "dataset_info.json").read_bytes())
        splits = info.get("splits") or {}
        counts = [int(split["num_examples"]) for split in splits.values()]
    except (OSError, orjson.JSONDecodeError, AttributeError, KeyError, TypeError, ValueError):
        return None
    return counts[0] if len(counts) == 1 else None
