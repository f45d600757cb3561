"""The files an export leaves: the umask's mode, and a clear error for a folder it cannot write."""

from __future__ import annotations

import os
import shutil
import stat
import tempfile
from collections.abc import Iterator
from pathlib import Path

import boto3
import orjson
import pyarrow.parquet as pq
import pytest
from typer.testing import CliRunner

from genfleet.cli import app
from genfleet.common.errors import ConfigError
from genfleet.common.settings import Settings
from genfleet.common.store import open_store
from genfleet.producer.export import export_run, shard_name
from tests.support.s3 import new_bucket
from tests.support.stored_runs import finish, prompts, read_jsonl, stage_prompts

RUN = "run-1"

NOBODY = 65534


@pytest.fixture
def shared_dir() -> Iterator[Path]:
    """A folder every user can read (pytest's tmp_path is private to its owner)."""
    path = Path(tempfile.mkdtemp(prefix="genfleet-export-"))
    path.chmod(0o755)
    yield path
    shutil.rmtree(path)


def finished_run(root: Path) -> Settings:
    settings = Settings(store=(root / "store").as_uri())
    store = open_store(settings.store)
    finish(store, stage_prompts(store, RUN, prompts(7), batch_size=3))
    return settings


@pytest.mark.parametrize(("umask", "mode"), [(0o022, 0o644), (0o077, 0o600), (0o002, 0o664)])
@pytest.mark.parametrize("fmt", ["jsonl", "parquet"])
def test_an_export_gets_the_mode_the_umask_gives(
    tmp_path: Path, umask: int, mode: int, fmt: str
) -> None:
    settings = finished_run(tmp_path)
    out = tmp_path / "out" / f"export.{fmt}"
    before = os.umask(umask)
    try:
        export_run(settings, RUN, str(out), fmt)
    finally:
        os.umask(before)
    assert stat.S_IMODE(out.stat().st_mode) == mode
    assert [p.name for p in out.parent.iterdir()] == [out.name]


def test_an_unwritable_folder_is_a_clear_error_naming_it_and_the_fix(shared_dir: Path) -> None:
    settings = finished_run(shared_dir)
    locked = shared_dir / "data"
    locked.mkdir(mode=0o555)
    locked.chmod(0o555)  # not even root's umask can widen it; root itself runs as nobody below
    out = locked / "export.jsonl"
    message = export_error(settings, out) if os.geteuid() else export_error_as_nobody(settings, out)
    assert f"cannot write the export into {locked}" in message
    assert "HOST_UID" in message and "HOST_GID" in message
    assert not out.exists()


def export_error(settings: Settings, out: Path) -> str:
    with pytest.raises(ConfigError) as caught:
        export_run(settings, RUN, str(out))
    return str(caught.value)


def export_error_as_nobody(settings: Settings, out: Path) -> str:
    """Root writes anywhere: export from a forked child that runs as nobody."""
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: drop to nobody, export, report the error, never return
        code = 1
        try:
            os.close(read_end)
            os.setgroups([])
            os.setgid(NOBODY)
            os.setuid(NOBODY)
            try:
                export_run(settings, RUN, str(out))
                os.write(write_end, b"no error")
            except ConfigError as exc:
                os.write(write_end, str(exc).encode())
                code = 0
            except BaseException as exc:  # noqa: BLE001 - reported to the parent
                os.write(write_end, repr(exc).encode())
        finally:
            os._exit(code)
    os.close(write_end)
    with os.fdopen(read_end, "rb") as reader:
        message = reader.read().decode()
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0, message
    return message


def test_file_store_objects_get_the_mode_the_umask_gives(tmp_path: Path) -> None:
    store = open_store((tmp_path / "store").as_uri())
    before = os.umask(0o027)
    try:
        store.put("r/manifest.json", b"{}")
        assert store.put_if_absent("r/outputs/batch-000000.jsonl.gz", b"x")
    finally:
        os.umask(before)
    for key in ("r/manifest.json", "r/outputs/batch-000000.jsonl.gz"):
        assert stat.S_IMODE((tmp_path / "store" / key).stat().st_mode) == 0o640, key


def test_shard_names_number_the_file_before_its_suffixes() -> None:
    assert shard_name("/data/x.jsonl", 3) == "/data/x-00003.jsonl"
    assert shard_name("out.jsonl.gz", 0) == "out-00000.jsonl.gz"
    assert shard_name("s3://b/exports/run.parquet", 12) == "s3://b/exports/run-00012.parquet"
    assert shard_name("/data/v1.2/x", 1) == "/data/v1.2/x-00001"


@pytest.mark.parametrize(("count", "sizes"), [(23, [10, 10, 3]), (20, [10, 10]), (4, [4])])
def test_sharded_exports_split_the_run_in_order(
    tmp_path: Path, count: int, sizes: list[int]
) -> None:
    settings = Settings(store=(tmp_path / "store").as_uri())
    store = open_store(settings.store)
    inputs = prompts(count)
    finish(store, stage_prompts(store, RUN, inputs, batch_size=3))
    out = tmp_path / "out" / "export.jsonl.gz"
    result = export_run(settings, RUN, str(out), "jsonl", shard_size=10)
    names = [f"export-{i:05d}.jsonl.gz" for i in range(len(sizes))]
    assert result.shards == [str(out.parent / name) for name in names]
    assert sorted(p.name for p in out.parent.iterdir()) == names  # no temp file, no empty shard
    shards = [read_jsonl(out.parent / name) for name in names]
    assert [len(rows) for rows in shards] == sizes
    assert [row["id"] for rows in shards for row in rows] == [p.id for p in inputs]
    assert result.records == count


def test_parquet_shards_and_a_bad_shard_size(tmp_path: Path) -> None:
    settings = finished_run(tmp_path)
    out = tmp_path / "pq" / "export.parquet"
    result = export_run(settings, RUN, str(out), "parquet", shard_size=3)
    tables = [pq.read_table(path) for path in result.shards]
    assert [t.num_rows for t in tables] == [3, 3, 1]
    assert [i for t in tables for i in t.column("id").to_pylist()] == [p.id for p in prompts(7)]
    with pytest.raises(ConfigError, match="shard-size"):
        export_run(settings, RUN, str(out), "jsonl", shard_size=0)


def test_sharded_export_to_s3_through_the_cli(tmp_path: Path, any_s3_server: str) -> None:
    settings = finished_run(tmp_path)
    bucket = new_bucket(any_s3_server).removeprefix("s3://").split("/")[0]
    result = CliRunner().invoke(
        app,
        ["export", RUN, "--out", f"s3://{bucket}/exports/run.jsonl", "--shard-size", "4"]
        + ["--store", settings.store, "--s3-endpoint-url", any_s3_server],
    )
    assert result.exit_code == 0, result.output
    assert "2 shards" in result.output
    client = boto3.client("s3", endpoint_url=any_s3_server, region_name="us-east-1")
    listed = client.list_objects_v2(Bucket=bucket, Prefix="exports/")["Contents"]
    assert [item["Key"] for item in listed] == [
        "exports/run-00000.jsonl",
        "exports/run-00001.jsonl",
    ]
    ids = [
        orjson.loads(line)["id"]
        for item in listed
        for line in client.get_object(Bucket=bucket, Key=item["Key"])["Body"].read().splitlines()
    ]
    assert ids == [p.id for p in prompts(7)]
