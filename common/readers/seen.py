"""The ids a reader has seen, in bounded memory: 16 bytes per id, exact.

A Python set of 10M id strings costs about a gigabyte. Here each id costs its 8-byte hash and
the 8-byte offset of its bytes in an anonymous temporary file (0600, unlinked at once, gone
with the process); the hashes live in sorted numpy arrays merged like a binary counter (about
log2(n / buffer) of them), so a chunk of ids is checked with a few vectorised searches. A hash
that matches is confirmed against the id's own bytes read back from the file: two ids that
share a hash are both kept, never called duplicates.
"""

from __future__ import annotations

import tempfile
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

_MASK = (1 << 64) - 1


def _digest(value: str) -> int:
    # The process's own string hash (SipHash, salted per process): 64 bits, already cached on
    # the str, and only ever compared within this process.
    return hash(value) & _MASK


class SeenIds:
    """`check(ids)` says, in order, which ids were seen before (in earlier calls or earlier in
    the same call) and remembers the others. `digest` is a seam for tests that force
    collisions."""

    def __init__(
        self,
        buffer_size: int = 1 << 16,
        digest: Callable[[str], int] = _digest,
        directory: str | None = None,
    ) -> None:
        self._digest = digest
        self._buffer_size = buffer_size
        self._buffer: dict[int, str] = {}  # digest → id, not yet in a level
        self._more: dict[int, list[str]] = {}  # further ids of a digest the buffer holds
        self._levels: list[tuple[Any, Any]] = []  # (sorted digests, offsets), both uint64
        self._log = tempfile.TemporaryFile(dir=directory)  # noqa: SIM115 - closed by close()
        self._end = 0

    def check(self, ids: Sequence[str]) -> list[bool]:
        digests = list(map(self._digest, ids))
        earlier = self._in_levels(digests)
        buffer = self._buffer
        seen: list[bool] = []
        for index, value in enumerate(ids):
            digest = digests[index]
            held = buffer.get(digest)
            if held is None and index not in earlier:  # nearly always: a new id
                buffer[digest] = value
                seen.append(False)
            else:
                seen.append(self._confirm(value, digest, held, earlier.get(index, [])))
        if len(buffer) + len(self._more) >= self._buffer_size:
            self._flush()
        return seen

    def close(self) -> None:
        self._log.close()
        self._levels.clear()
        self._buffer.clear()
        self._more.clear()

    def _confirm(self, value: str, digest: int, held: str | None, offsets: list[int]) -> bool:
        """A digest seen before: the id itself decides. Remembers it when it is new."""
        if value == held or value in self._more.get(digest, ()):
            return True
        if any(self._read(offset) == value for offset in offsets):
            return True
        if held is None:
            self._buffer[digest] = value
        else:
            self._more.setdefault(digest, []).append(value)
        return False

    def _in_levels(self, digests: list[int]) -> dict[int, list[int]]:
        """Offsets of ids already in a level whose digest equals digests[i], by i."""
        if not self._levels or not digests:
            return {}
        wanted = np.fromiter(digests, dtype=np.uint64, count=len(digests))
        found: dict[int, list[int]] = {}
        for level, offsets in self._levels:
            left = np.searchsorted(level, wanted, side="left")
            right = np.searchsorted(level, wanted, side="right")
            for i in np.nonzero(right > left)[0].tolist():
                found.setdefault(i, []).extend(offsets[left[i] : right[i]].tolist())
        return found

    def _read(self, offset: int) -> str:
        self._log.seek(offset)
        size = int.from_bytes(self._log.read(4), "little")
        return self._log.read(size).decode("utf-8", "surrogatepass")

    def _flush(self) -> None:
        """The buffer becomes a sorted level; levels merge while the newer is as big, up to
        MAX_LEVEL ids each (a merge's transient memory stays bounded whatever the run)."""
        pairs = list(self._buffer.items())
        pairs += [(d, v) for d, values in self._more.items() for v in values]
        self._buffer.clear()
        self._more.clear()
        blobs = [value.encode("utf-8", "surrogatepass") for _, value in pairs]
        sizes = np.fromiter(map(len, blobs), dtype=np.uint64, count=len(blobs)) + 4
        offsets = np.cumsum(sizes) - sizes + np.uint64(self._end)
        self._log.seek(self._end)
        self._log.write(b"".join(len(b).to_bytes(4, "little") + b for b in blobs))
        self._end += int(sizes.sum())
        level = np.fromiter((d for d, _ in pairs), dtype=np.uint64, count=len(pairs))
        del pairs, blobs
        order = np.argsort(level, kind="stable")
        self._levels.append((level[order], offsets[order]))
        while len(self._levels) > 1:
            older, newer = self._levels[-2][0], self._levels[-1][0]
            if len(older) > 2 * len(newer) or len(older) + len(newer) > MAX_LEVEL:
                break
            newest = self._levels.pop()
            self._levels.append(_merge(self._levels.pop(), newest))


# Ids per sorted level at most: 4M ids (64 MB) per level, about 120 MB at the peak of a merge.
MAX_LEVEL = 1 << 22


def _merge(older: tuple[Any, Any], newer: tuple[Any, Any]) -> tuple[Any, Any]:
    """Two sorted levels as one, without sorting again: each of `newer`'s digests goes after
    the equal ones of `older` (searchsorted), the rest fill the gaps in order."""
    (a, ao), (b, bo) = older, newer
    at = np.searchsorted(a, b, side="right") + np.arange(len(b))
    rest = np.ones(len(a) + len(b), dtype=bool)
    rest[at] = False
    digests = np.empty(len(rest), dtype=np.uint64)
    digests[at], digests[rest] = b, a
    offsets = np.empty(len(rest), dtype=np.uint64)
    offsets[at], offsets[rest] = bo, ao
    return digests, offsets
