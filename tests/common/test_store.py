from __future__ import annotations

import os
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from urllib.parse import urlparse

import pytest

from genfleet.common.errors import ConfigError, StoreError
from genfleet.common.store import FileStore, S3Store, Store, open_store
from harness.services import FlakyProxy
from tests.fakes.memory_store import MemoryStore
from tests.support.s3 import new_bucket


@pytest.fixture(params=["file", "moto", "seaweedfs", "memory"])
def store(request: pytest.FixtureRequest, tmp_path: Path) -> Store:
    """The store contract runs on the real backends (a directory, moto's S3, SeaweedFS: the
    stack's S3) and on the in-memory fake the unit tests use, so the fake behaves as they do."""
    if request.param == "file":
        return open_store((tmp_path / "store").as_uri())
    if request.param == "memory":
        return MemoryStore()
    endpoint = request.getfixturevalue(
        "s3_server" if request.param == "moto" else "seaweedfs_server"
    )
    return open_store(new_bucket(endpoint), endpoint)


def test_write_once(store: Store) -> None:
    assert store.put_if_absent("r/outputs/batch-000000.jsonl.gz", b"first") is True
    assert store.put_if_absent("r/outputs/batch-000000.jsonl.gz", b"second") is False
    assert store.get("r/outputs/batch-000000.jsonl.gz") == b"first"
    assert store.exists("r/outputs/batch-000000.jsonl.gz")
    assert not store.exists("r/outputs/batch-000001.jsonl.gz")
    assert store.get("r/outputs/batch-000001.jsonl.gz") is None


def test_put_overwrites_and_list_is_sorted(store: Store) -> None:
    store.put("r/manifest.json", b"1")
    store.put("r/manifest.json", b"2")
    assert store.get("r/manifest.json") == b"2"
    for i in (3, 1, 2):
        store.put(f"r/inputs/batch-00000{i}.jsonl.gz", b"x")
    store.put("other/inputs/batch-000001.jsonl.gz", b"x")
    assert list(store.list("r/inputs/")) == [
        "r/inputs/batch-000001.jsonl.gz",
        "r/inputs/batch-000002.jsonl.gz",
        "r/inputs/batch-000003.jsonl.gz",
    ]
    assert store.delete_prefix("r/inputs/") == 3
    assert list(store.list("r/inputs/")) == []
    assert store.delete_prefix("r/inputs/") == 0
    assert list(store.list("other/")) == ["other/inputs/batch-000001.jsonl.gz"]


def test_list_takes_a_partial_name_as_prefix(store: Store) -> None:
    store.put("r/parts/batch-000001/part-00000.jsonl.gz", b"a")
    store.put("r/parts/batch-000001/part-00001.jsonl.gz", b"b")
    store.put("r/parts/batch-000002/part-00000.jsonl.gz", b"c")
    assert list(store.list("r/parts/batch-000001/")) == [
        "r/parts/batch-000001/part-00000.jsonl.gz",
        "r/parts/batch-000001/part-00001.jsonl.gz",
    ]
    assert list(store.list("r/nothing/")) == []


def test_concurrent_put_if_absent_has_one_winner(store: Store) -> None:
    wins: list[bool] = []
    lock = threading.Lock()

    def put(i: int) -> None:
        won = store.put_if_absent("r/outputs/race.jsonl.gz", f"writer {i}".encode())
        with lock:
            wins.append(won)

    threads = [threading.Thread(target=put, args=(i,)) for i in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert sorted(wins) == [False] * 7 + [True]


def test_file_store_refuses_escaping_keys(tmp_path: Path) -> None:
    store = FileStore(tmp_path)
    with pytest.raises(StoreError, match="escapes"):
        store.put("../outside", b"x")


@pytest.mark.parametrize("url", ["gs://bucket", "file://relative/path", "s3://"])
def test_bad_store_urls(url: str) -> None:
    with pytest.raises(ConfigError):
        open_store(url)


def test_deletes_take_only_their_prefix_and_free_the_key(store: Store) -> None:
    store.put("r/inputs/batch-000001.jsonl.gz", b"a")
    store.put("r/inputs/batch-000002.jsonl.gz", b"b")
    store.put("r/inputs-old/batch-000001.jsonl.gz", b"c")
    assert store.put_if_absent("r/outputs/batch-000001.jsonl.gz", b"first")
    assert store.delete_prefix("r/inputs/") == 2
    assert store.delete_prefix("r/inputs/") == 0
    assert list(store.list("r/inputs")) == ["r/inputs-old/batch-000001.jsonl.gz"]
    assert store.delete_prefix("r/outputs/") == 1
    assert not store.exists("r/outputs/batch-000001.jsonl.gz")
    # write-once guards what exists: a deleted output can be written again, once
    assert store.put_if_absent("r/outputs/batch-000001.jsonl.gz", b"again")
    assert not store.put_if_absent("r/outputs/batch-000001.jsonl.gz", b"third")
    assert store.get("r/outputs/batch-000001.jsonl.gz") == b"again"


def test_large_objects_round_trip_byte_for_byte(store: Store) -> None:
    data = os.urandom(1 << 20) * 24  # 24 MiB, above any single-buffer shortcut
    assert store.put_if_absent("r/outputs/big.jsonl.gz", data)
    assert not store.put_if_absent("r/outputs/big.jsonl.gz", b"small")
    assert store.get("r/outputs/big.jsonl.gz") == data
    store.put("r/exports/big.jsonl", data[::-1])
    assert store.get("r/exports/big.jsonl") == data[::-1]


@pytest.mark.slow
def test_listing_pages_past_a_thousand_keys(store: Store) -> None:
    names = [f"r/outputs/batch-{i:06d}.jsonl.gz" for i in range(1010)]
    with ThreadPoolExecutor(16) as pool:
        assert all(pool.map(lambda key: store.put_if_absent(key, b"x"), names))
    assert list(store.list("r/outputs/")) == names
    assert list(store.list("r/outputs/batch-0010")) == names[1000:]


@pytest.mark.slow
@pytest.mark.parametrize("server", ["s3_server", "seaweedfs_server"])
def test_s3_calls_retry_through_an_outage(request: pytest.FixtureRequest, server: str) -> None:
    endpoint = request.getfixturevalue(server)
    url = new_bucket(endpoint)
    port = int(endpoint.rsplit(":", 1)[1])
    proxy = FlakyProxy(("127.0.0.1", port))
    try:
        sleeps: list[float] = []

        def sleep(seconds: float) -> None:  # the outage ends during the store's first backoff
            sleeps.append(seconds)
            proxy.restore()

        parsed = urlparse(url)
        store = S3Store(parsed.netloc, parsed.path, proxy.url, "us-east-1", 4, sleep)
        proxy.cut()
        assert store.put_if_absent("r/outputs/batch-000000.jsonl.gz", b"once")
        assert len(sleeps) == 1 and proxy.refused > 0
        assert not store.put_if_absent("r/outputs/batch-000000.jsonl.gz", b"twice")

    finally:
        proxy.close()
    assert open_store(url, endpoint).get("r/outputs/batch-000000.jsonl.gz") == b"once"


def test_folders_are_the_top_level_names_alone(store: Store) -> None:
    assert list(store.folders()) == []
    store.put("run-b/manifest.json", b"{}")
    store.put("run-a/inputs/batch-000000.jsonl.gz", b"x")
    store.put("run-a/outputs/batch-000000.jsonl.gz", b"y")
    assert list(store.folders()) == ["run-a", "run-b"]
