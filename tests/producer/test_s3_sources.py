"""Datasets read from S3 (a file, a folder of shards; JSONL, gzip, Parquet), streamed in ranges.

Each test runs on moto and on SeaweedFS, the stack's S3 server: a source read from a bucket
yields exactly what the same files yield from disk.
"""

from __future__ import annotations

import gzip
import io
from pathlib import Path
from typing import Any

import orjson
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import redis

from genfleet.common.errors import InputError
from genfleet.common.manifest import Manifest
from genfleet.common.readers import ReadAs, ReaderOptions, read_source
from genfleet.common.readers.jsonl import read_jsonl
from genfleet.common.readers.s3source import CHUNK_BYTES, s3_source
from genfleet.common.settings import Settings
from genfleet.common.store import open_store
from genfleet.producer.enqueue import enqueue_run, reader_options
from genfleet.producer.status import run_status
from harness.sources import corrupt_parquet
from tests.support.s3 import Bucket, new_bucket

pytestmark = pytest.mark.integration


def jsonl(rows: list[dict[str, Any]]) -> bytes:
    return b"".join(orjson.dumps(row) + b"\n" for row in rows)


def prompts(start: int, count: int) -> list[dict[str, Any]]:
    return [{"id": f"p{i:05d}", "prompt": f"question {i}"} for i in range(start, start + count)]


def parquet(rows: list[dict[str, Any]]) -> bytes:
    sink = io.BytesIO()
    pq.write_table(pa.Table.from_pylist(rows), sink, row_group_size=7)
    return sink.getvalue()


def ids(source: str, options: ReaderOptions) -> list[str]:
    items = list(read_source(source, options))
    assert all(hasattr(item, "messages") for item in items), items
    return [item.id for item in items]  # type: ignore[union-attr]


def test_a_jsonl_file_reads_as_it_does_from_disk(bucket: Bucket, tmp_path: Path) -> None:
    rows = [*prompts(0, 3), {"id": "bad", "prompt": ""}, *prompts(3, 3)]
    url = bucket.put("data/prompts.jsonl", jsonl(rows))
    local = tmp_path / "prompts.jsonl"
    local.write_bytes(jsonl(rows))
    from_s3 = list(read_source(url, bucket.options()))
    from_disk = list(read_source(str(local), ReaderOptions()))
    assert [repr(i).replace(url, "SRC") for i in from_s3] == [
        repr(i).replace(str(local), "SRC") for i in from_disk
    ]
    assert len(from_s3) == 7  # six prompts and one reject naming the S3 URL
    assert any(url in str(item) for item in from_s3)


def test_a_folder_of_shards_reads_in_name_order(bucket: Bucket) -> None:
    bucket.put("shards/part-0001.jsonl.gz", gzip.compress(jsonl(prompts(10, 10))))
    bucket.put("shards/part-0000.jsonl", jsonl(prompts(0, 10)))
    bucket.put("shards/part-0002.jsonl", jsonl(prompts(20, 5)))
    bucket.put("shards/README.md", b"not a shard")
    bucket.put("shards/old/part-0000.jsonl", jsonl(prompts(100, 5)))  # deeper: not a shard
    bucket.put("shards-other/part-0000.jsonl", jsonl(prompts(200, 5)))  # a sibling prefix
    expected = [f"p{i:05d}" for i in range(25)]
    for url in (f"s3://{bucket.name}/shards", f"s3://{bucket.name}/shards/"):
        assert ids(url, bucket.options()) == expected


def test_parquet_files_and_folders_stream_by_row_group(bucket: Bucket) -> None:
    one = bucket.put("pq/single.parquet", parquet(prompts(0, 30)))
    assert ids(one, bucket.options()) == [f"p{i:05d}" for i in range(30)]
    bucket.put("pqdir/b.parquet", parquet(prompts(30, 10)))
    bucket.put("pqdir/a.parquet", parquet(prompts(0, 30)))
    assert ids(f"s3://{bucket.name}/pqdir/", bucket.options()) == [f"p{i:05d}" for i in range(40)]
    assert ids(f"s3://{bucket.name}/pqdir/", bucket.options(limit=5)) == [
        f"p{i:05d}" for i in range(5)
    ]


def test_a_large_file_is_read_in_ranges_not_copied_whole(bucket: Bucket) -> None:
    rows = [{"id": f"p{i:06d}", "prompt": "x" * 900} for i in range(24_000)]  # ~22 MiB
    data = jsonl(rows)
    url = bucket.put("big/prompts.jsonl", data)
    path = s3_source(url, bucket.endpoint, "us-east-1")
    ranges: list[str] = []
    path._client.meta.events.register(
        "provide-client-params.s3.GetObject", lambda params, **_: ranges.append(params["Range"])
    )
    items = (item for item in read_jsonl(path, ReaderOptions()) if not isinstance(item, ReadAs))
    assert next(items)[-1].id == "p000000"  # type: ignore[index]
    # the first record needed one range only (the rows held to find the file's shape in it)
    assert ranges == [f"bytes=0-{CHUNK_BYTES - 1}"]
    count = 1 + sum(1 for _ in items)
    assert count == len(rows)
    spans = [tuple(int(n) for n in r.removeprefix("bytes=").split("-")) for r in ranges]
    assert all(end - start + 1 <= CHUNK_BYTES for start, end in spans)
    assert sum(end - start + 1 for start, end in spans) == len(data)  # each byte fetched once


def test_a_missing_source_is_an_input_error(bucket: Bucket) -> None:
    with pytest.raises(InputError, match="no such file or directory"):
        list(read_source(f"s3://{bucket.name}/nothing/here.jsonl", bucket.options()))
    with pytest.raises(InputError, match="cannot tell the format"):
        list(read_source(bucket.put("data/prompts.txt", b"{}"), bucket.options()))


def test_enqueue_stages_an_s3_source_through_the_store_settings(
    bucket: Bucket, redis_url: str
) -> None:
    url = bucket.put("incoming/prompts.jsonl.gz", gzip.compress(jsonl(prompts(0, 23))))
    settings = Settings(
        redis_url=redis_url,
        store=new_bucket(bucket.endpoint),
        s3_endpoint_url=bucket.endpoint,
        batch_size=10,
    )
    result = enqueue_run(settings, "from-s3", url, reader_options(settings))
    assert (result.prompts, result.batches_total, result.batches_enqueued) == (23, 3, 3)
    store = open_store(settings.store, bucket.endpoint)
    manifest = orjson.loads(store.get("from-s3/manifest.json") or b"{}")
    assert manifest["source"] == url and manifest["prompts_total"] == 23


def test_default_ids_in_an_s3_folder_name_the_shard(bucket: Bucket) -> None:
    bucket.put("noids/a.jsonl", jsonl([{"prompt": "one"}, {"prompt": "two"}]))
    bucket.put("noids/b.jsonl", jsonl([{"prompt": "three"}]))
    assert ids(f"s3://{bucket.name}/noids/", bucket.options()) == [
        "a.jsonl:1",
        "a.jsonl:2",
        "b.jsonl:1",
    ]


def test_a_source_replaced_while_it_is_read_fails_even_at_the_same_length(
    bucket: Bucket,
) -> None:
    rows = prompts(0, 50)
    url = bucket.put("changing/prompts.jsonl", jsonl(rows))
    edited = jsonl([{**row, "prompt": row["prompt"].upper()} for row in rows])
    assert len(edited) == len(jsonl(rows))
    with s3_source(url, bucket.endpoint, "us-east-1").open() as handle:
        raw = handle.raw  # ranged GETs of the object as it was when opened
        assert raw.read(10) == jsonl(rows)[:10]
        bucket.put("changing/prompts.jsonl", edited)
        with pytest.raises(InputError, match="changed while it was read"):
            raw.read(10)


def test_a_run_staged_from_a_corrupt_parquet_says_it_holds_less_than_its_source(
    bucket: Bucket, redis_url: str, redis_client: redis.Redis, tmp_path: Path
) -> None:
    local = corrupt_parquet(tmp_path / "data.parquet", 500, 100, bad_group=3)
    url = bucket.put("incoming/data.parquet", local.read_bytes())
    settings = Settings(
        redis_url=redis_url,
        store=new_bucket(bucket.endpoint),
        s3_endpoint_url=bucket.endpoint,
        batch_size=100,
    )
    result = enqueue_run(settings, "cut", url, reader_options(settings))
    assert (result.prompts, result.rejects) == (400, 1)
    assert (result.sources_unread, result.rows_unread) == ([url], 100)
    store = open_store(settings.store, bucket.endpoint)
    manifest = Manifest.load(store, "cut")
    assert manifest is not None
    assert (manifest.sources_unread, manifest.rows_unread) == ([url], 100)
    report = run_status(store, redis_client, "cut")
    assert (report["sources_unread"], report["rows_unread"]) == ([url], 100)
