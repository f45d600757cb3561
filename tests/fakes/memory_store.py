"""A store in a dict: the `Store` protocol, write-once and thread-safe, nothing on disk."""

from __future__ import annotations

import threading
from collections.abc import Iterator, Sequence

from genfleet.common.store import Store


class MemoryStore:
    """Objects by key in memory; `put_if_absent` has one winner among threads, as on S3.
    `reads` lists the keys `get` was asked for, in order (what a reader touched)."""

    def __init__(self, url: str = "memory://store") -> None:
        self.url = url
        self.objects: dict[str, bytes] = {}
        self.reads: list[str] = []
        self._lock = threading.Lock()

    def put_if_absent(self, key: str, data: bytes) -> bool:
        with self._lock:
            if key in self.objects:
                return False
            self.objects[key] = bytes(data)
            return True

    def put(self, key: str, data: bytes) -> None:
        with self._lock:
            self.objects[key] = bytes(data)

    def get(self, key: str) -> bytes | None:
        with self._lock:
            self.reads.append(key)
            return self.objects.get(key)

    def exists(self, key: str) -> bool:
        with self._lock:
            return key in self.objects

    def list(self, prefix: str) -> Iterator[str]:
        with self._lock:
            keys = sorted(k for k in self.objects if k.startswith(prefix))
        yield from keys

    def delete_prefix(self, prefix: str) -> int:
        with self._lock:
            doomed = [k for k in self.objects if k.startswith(prefix)]
            for key in doomed:
                del self.objects[key]
        return len(doomed)

    def folders(self) -> Sequence[str]:
        with self._lock:
            return sorted({k.split("/", 1)[0] for k in self.objects if "/" in k})


def _is_a_store(store: MemoryStore) -> Store:
    return store  # a type checker sees here that MemoryStore is a Store
