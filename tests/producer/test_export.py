"""Exports of finished and unfinished runs, to local files and to S3, in every format."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import orjson
import pyarrow.parquet as pq
import pytest

from genfleet.common import keys
from genfleet.common.errors import ConfigError
from genfleet.common.readers import ReaderOptions
from genfleet.common.records import (
    PromptRecord,
    decode_jsonl_gz,
    encode_jsonl_gz,
)
from genfleet.common.settings import Settings
from genfleet.common.store import Store, open_store
from genfleet.producer import export as export_module
from genfleet.producer.enqueue import stage
from genfleet.producer.export import OutputMismatch, RunIncomplete, export_run
from tests.support.stored_runs import (
    completion,
    finish,
    line_sha256s,
    prompts,
    read_jsonl,
    stage_prompts,
)

RUN = "run-1"


@pytest.fixture
def settings(tmp_path: Path) -> Settings:
    return Settings(store=(tmp_path / "store").as_uri())


@pytest.fixture
def store(settings: Settings) -> Store:
    return open_store(settings.store)


def test_jsonl_export_is_complete_and_in_input_order(
    settings: Settings, store: Store, tmp_path: Path
) -> None:
    inputs = prompts(23)
    inputs[5].id = "p0005!"
    manifest = stage_prompts(store, RUN, inputs, batch_size=4)
    finish(store, manifest)
    out = tmp_path / "out" / "export.jsonl"
    result = export_run(settings, RUN, str(out), "jsonl")
    rows = read_jsonl(out)
    assert [r["id"] for r in rows] == [p.id for p in inputs]
    assert (result.records, result.errors, result.duplicates) == (23, 1, 0)
    assert (result.batches_total, result.batches_exported, result.missing_batches) == (6, 6, [])
    staged = decode_jsonl_gz(store.get(keys.input_key(RUN, "batch-000000")) or b"")
    digest = line_sha256s(orjson.dumps(next(staged)))[0]
    assert rows[0] == {**completion(inputs[0], RUN, "batch-000000"), "prompt_sha256": digest}
    assert [p.name for p in out.parent.iterdir()] == ["export.jsonl"]  # no temp file left


def test_duplicates_within_a_batch_are_dropped(
    settings: Settings, store: Store, tmp_path: Path
) -> None:
    inputs = [PromptRecord(p.id, p.messages, s) for p in prompts(5) for s in range(2)]
    manifest = stage_prompts(store, RUN, inputs, batch_size=3)
    finish(store, manifest, repeat=2)
    out = tmp_path / "export.jsonl.gz"
    result = export_run(settings, RUN, str(out), "jsonl")
    rows = read_jsonl(out)
    assert [(r["id"], r["sample"]) for r in rows] == [p.key for p in inputs]
    assert (result.records, result.duplicates) == (10, 10)


def test_unfinished_run_raises_unless_partial(
    settings: Settings, store: Store, tmp_path: Path
) -> None:
    inputs = prompts(10)
    manifest = stage_prompts(store, RUN, inputs, batch_size=2)
    finish(store, manifest, skip=frozenset({"batch-000001", "batch-000003"}))
    out = tmp_path / "export.jsonl"
    with pytest.raises(RunIncomplete, match="2 of 5 batches") as caught:
        export_run(settings, RUN, str(out), "jsonl")
    assert caught.value.missing == ["batch-000001", "batch-000003"]
    assert "batch-000001, batch-000003" in str(caught.value) and "--partial" in str(caught.value)
    assert list(tmp_path.glob("*.jsonl")) == []

    result = export_run(settings, RUN, str(out), "jsonl", partial=True)
    assert [r["id"] for r in read_jsonl(out)] == [
        "p0000",
        "p0001",
        "p0004",
        "p0005",
        "p0008",
        "p0009",
    ]
    assert result.missing_batches == ["batch-000001", "batch-000003"]
    assert (result.records, result.batches_exported) == (6, 3)


def test_output_vanishing_during_export_counts_as_missing(
    settings: Settings, store: Store, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    manifest = stage_prompts(store, RUN, prompts(4), batch_size=2)
    finish(store, manifest)
    real_get = store.get
    gone = keys.output_key(RUN, "batch-000000")

    class Vanishing:
        def __getattr__(self, name: str) -> Any:
            return getattr(store, name)

        def get(self, key: str) -> bytes | None:
            return None if key == gone else real_get(key)

    monkeypatch.setattr(export_module, "store_of", lambda *args: Vanishing())
    with pytest.raises(RunIncomplete):
        export_run(settings, RUN, str(tmp_path / "x.jsonl"))
    assert not (tmp_path / "x.jsonl").exists()
    result = export_run(settings, RUN, str(tmp_path / "x.jsonl"), partial=True)
    assert (result.records, result.missing_batches) == (2, ["batch-000000"])


def test_openai_batch_round_trip(settings: Settings, store: Store, tmp_path: Path) -> None:
    source = tmp_path / "requests.jsonl"
    requests = [
        {
            "custom_id": f"request-{i}" + ("!" if i == 3 else ""),
            "method": "POST",
            "url": "/v1/chat/completions",
            "body": {
                "model": "gpt-x",
                "messages": [{"role": "user", "content": f"q{i}"}],
                "max_tokens": 5 + i,
            },
        }
        for i in range(7)
    ]
    source.write_bytes(b"".join(orjson.dumps(r) + b"\n" for r in requests))
    settings = settings.model_copy(update={"batch_size": 3})
    manifest, staged = stage(
        settings, store, RUN, str(source), ReaderOptions(), lambda orders: len(orders), set()
    )
    assert staged.prompts == 7 and manifest.batches_total == 3
    finish(store, manifest)
    out = tmp_path / "results.jsonl"
    result = export_run(settings, RUN, str(out), "openai")
    lines = read_jsonl(out)
    assert [line["custom_id"] for line in lines] == [r["custom_id"] for r in requests]
    assert (result.records, result.errors) == (7, 1)
    for line in lines:
        assert set(line) == {"id", "custom_id", "response", "error"}
        assert line["id"].startswith("batch_req_")
    ok, failed = lines[0], lines[3]
    assert ok["error"] is None
    response = ok["response"]
    assert response["status_code"] == 200 and response["request_id"] == "r-request-0-0"
    body = response["body"]
    assert body["object"] == "chat.completion" and body["model"] == "test-model"
    assert body["choices"][0]["message"] == {
        "role": "assistant",
        "content": "answer to request-0",
        "reasoning_content": "thinking about request-0",
    }
    assert body["choices"][0]["finish_reason"] == "stop"
    assert body["usage"] == {
        "prompt_tokens": 10,
        "completion_tokens": 20,
        "total_tokens": 30,
        "completion_tokens_details": {"reasoning_tokens": 5},
    }
    assert failed["response"] is None
    assert failed["error"] == {"code": "context_length", "message": "too long"}
    # The per-line parameters reached the staged batches the workers read.
    first = next(decode_jsonl_gz(store.get(keys.input_key(RUN, "batch-000000")) or b""))
    assert first["params"] == {"max_tokens": 5} and first["custom_id"] == "request-0"
    # Deterministic: a second export is byte-identical.
    again = tmp_path / "again.jsonl"
    export_run(settings, RUN, str(again), "openai")
    assert again.read_bytes() == out.read_bytes()


def test_parquet_export_has_the_fixed_schema_and_several_row_groups(
    settings: Settings, store: Store, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(export_module._ParquetWriter, "ROW_GROUP_ROWS", 4)
    inputs = prompts(10)
    inputs[2].id = "p0002!"
    inputs[4].messages = [{"role": "user", "content": [{"type": "text", "text": "parts"}]}]
    manifest = stage_prompts(store, RUN, inputs, batch_size=3)
    finish(store, manifest)
    out = tmp_path / "export.parquet"
    result = export_run(settings, RUN, str(out), "parquet")
    handle = pq.ParquetFile(out)
    assert handle.schema_arrow == export_module.parquet_schema()
    assert handle.metadata.num_row_groups == 3 and result.records == 10
    rows = handle.read().to_pylist()
    assert [r["id"] for r in rows] == [p.id for p in inputs]
    assert rows[0]["usage"] == {"prompt_tokens": 10, "completion_tokens": 20, "reasoning_tokens": 5}
    assert rows[0]["messages"][0]["content"] == "q0" and rows[0]["error"] is None
    assert orjson.loads(rows[0]["engine"]) == {"kind": "emulator", "worker": "w1"}
    assert rows[2]["error"] == {"type": "context_length", "message": "too long"}
    assert orjson.loads(rows[4]["messages"][0]["content"]) == [{"type": "text", "text": "parts"}]


def test_bad_arguments(settings: Settings, store: Store, tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="no manifest"):
        export_run(settings, "nothing-here", str(tmp_path / "x.jsonl"))
    with pytest.raises(ConfigError, match="format"):
        export_run(settings, RUN, str(tmp_path / "x.csv"), "csv")
    with pytest.raises(ConfigError, match="s3://bucket/key"):
        export_run(settings, RUN, "s3://bucket-only", "jsonl")
    with pytest.raises(ValueError, match="not allowed"):
        export_run(settings, "../escape", str(tmp_path / "x.jsonl"))


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


@pytest.fixture
def s3_endpoint(monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    """A real S3 protocol server (moto) on a free loopback port, with one bucket."""
    from moto.server import ThreadedMotoServer

    for name, value in {
        "AWS_ACCESS_KEY_ID": "testing",
        "AWS_SECRET_ACCESS_KEY": "testing",
        "AWS_DEFAULT_REGION": "us-east-1",
    }.items():
        monkeypatch.setenv(name, value)
    port = free_port()
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    endpoint = f"http://127.0.0.1:{port}"
    import boto3

    boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1").create_bucket(Bucket="bkt")
    yield endpoint
    server.stop()


@pytest.mark.integration
def test_s3_store_to_s3_export(s3_endpoint: str) -> None:
    import boto3

    settings = Settings(store="s3://bkt/runs", s3_endpoint_url=s3_endpoint)
    store = open_store(settings.store, s3_endpoint)
    inputs = prompts(9)
    manifest = stage_prompts(store, RUN, inputs, batch_size=4)
    finish(store, manifest)
    result = export_run(settings, RUN, "s3://bkt/exports/run-1.jsonl.gz", "jsonl")
    assert result.records == 9
    client = boto3.client("s3", endpoint_url=s3_endpoint, region_name="us-east-1")
    body = client.get_object(Bucket="bkt", Key="exports/run-1.jsonl.gz")["Body"].read()
    assert [r["id"] for r in decode_jsonl_gz(body)] == [p.id for p in inputs]


def test_every_sample_exports_as_its_own_custom_id(
    settings: Settings, store: Store, tmp_path: Path
) -> None:
    source = tmp_path / "requests.jsonl"
    body = {"model": "m", "messages": [{"role": "user", "content": "q"}], "seed": 3}
    requests = [{"custom_id": f"req-{i}", "body": body} for i in range(2)]
    source.write_bytes(b"".join(orjson.dumps(r) + b"\n" for r in requests))
    settings = settings.model_copy(update={"samples": 3})
    manifest, _ = stage(
        settings,
        store,
        RUN,
        str(source),
        ReaderOptions(samples=3),
        lambda orders: len(orders),
        set(),
    )
    finish(store, manifest)
    out = tmp_path / "results.jsonl"
    export_run(settings, RUN, str(out), "openai")
    ids = [line["custom_id"] for line in read_jsonl(out)]
    assert ids == [
        "req-0", "req-0-sample-1", "req-0-sample-2", "req-1", "req-1-sample-1", "req-1-sample-2"
    ]  # fmt: skip


def test_an_output_that_does_not_answer_the_staged_prompts_is_not_exported(
    settings: Settings, store: Store, tmp_path: Path
) -> None:
    source = tmp_path / "prompts.jsonl"
    source.write_bytes(b"".join(orjson.dumps({"prompt": f"q{i}"}) + b"\n" for i in range(6)))
    settings = settings.model_copy(update={"batch_size": 3})
    manifest, _ = stage(
        settings, store, RUN, str(source), ReaderOptions(), lambda orders: len(orders), set()
    )
    finish(store, manifest, skip=frozenset({"batch-000001"}))
    # batch-000001's output answers other prompts under the same ids (an interrupted staging
    # of other data, finished by a worker before the input was staged anew).
    entry = manifest.entry(store, "batch-000001")
    assert entry is not None
    old = [
        PromptRecord(p["id"], [{"role": "user", "content": "old " + str(i)}])
        for i, p in enumerate(decode_jsonl_gz(store.get(entry.key) or b""))
    ]
    digests = line_sha256s(b"".join(orjson.dumps(p.to_json()) + b"\n" for p in old))
    rows = [
        {**completion(p, RUN, entry.batch), "prompt_sha256": d}
        for p, d in zip(old, digests, strict=True)
    ]
    store.put_if_absent(keys.output_key(RUN, entry.batch), encode_jsonl_gz(rows))
    out = tmp_path / "out.jsonl"

    with pytest.raises(OutputMismatch, match="batch-000001 does not answer"):
        export_run(settings, RUN, str(out), "jsonl")
    assert not out.exists()


def test_parquet_without_pyarrow_is_a_clear_error_not_a_traceback(tmp_path: Path) -> None:
    """`genfleet export --format parquet` where pyarrow is not installed: exit 1 and the extra
    that brings it, before anything is read."""
    probe = (
        "import sys\n"
        "class Block:\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name == 'pyarrow' or name.startswith('pyarrow.'):\n"
        "            raise ImportError('pyarrow is not installed')\n"
        "sys.meta_path.insert(0, Block())\n"
        "from genfleet.cli import main\n"
        "sys.argv = ['genfleet', 'export', 'any-run', '--format', 'parquet',\n"
        "            '--out', 'x.parquet']\n"
        "main()\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", probe],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=60,
        env={
            **{k: v for k, v in os.environ.items() if not k.startswith("GENFLEET_")},
            "GENFLEET_STORE": (tmp_path / "store").as_uri(),
            "GENFLEET_REDIS_URL": "redis://127.0.0.1:1/0",  # never reached
        },
    )
    assert done.returncode != 0
    assert "genfleet[formats]" in done.stderr + done.stdout
    assert "Traceback" not in done.stderr + done.stdout
    assert not (tmp_path / "x.parquet").exists()
