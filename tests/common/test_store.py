from __future__ import annotations

import threading
from pathlib import Path

import pytest

from genfleet.common.errors import ConfigError, StoreError
from genfleet.common.store import FileStore, Store, open_store
from tests.fakes.memory_store import MemoryStore


@pytest.fixture(params=["file", "s3", "memory"])
def store(request: pytest.FixtureRequest, tmp_path: Path) -> Store:
    """The store contract runs on the real backends (a directory, moto's S3) and on the
    in-memory fake the unit tests use, so the fake behaves as they do."""
    if request.param == "file":
        return open_store((tmp_path / "store").as_uri())
    if request.param == "memory":
        return MemoryStore()
    url = request.getfixturevalue("s3_store_url")
    return open_store(url, request.getfixturevalue("s3_server"))


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
