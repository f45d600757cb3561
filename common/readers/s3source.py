"""Datasets in S3: `s3://bucket/key` (one file) or `s3://bucket/prefix/` (a folder of shards).

`S3Path` offers the part of `pathlib.Path` the readers use (`name`, `/`, `exists`, `is_dir`,
`glob`, `open`, `read_bytes`), so JSONL and Parquet sources are read by the same code whether
they sit on disk or in a bucket. `open` streams: sequential reads fetch 8 MiB ranges, and
Parquet's seeks (footer first, then row groups) become ranged GETs, so a dataset is never
copied whole to local disk or memory. The client is the store's (same endpoint, region and
credentials from the standard AWS variables); failed reads are InputErrors naming the URL.
"""

from __future__ import annotations

import fnmatch
import io
from pathlib import Path
from typing import IO, Any

from genfleet.common.errors import InputError
from genfleet.common.store import s3_client

CHUNK_BYTES = 8 * 1024 * 1024


def _client_error(url: str, exc: Exception) -> InputError:
    return InputError(f"{url}: cannot read from S3: {exc}")


class _RangedReader(io.RawIOBase):
    """A seekable, read-only view of one version of an S3 object; every read is a ranged GET
    conditional on the ETag the object had when it was opened (`IfMatch`), so an object
    replaced while it is read, even by one of the same length, fails the read (412) instead of
    giving a mix of two versions."""

    def __init__(
        self, client: Any, bucket: str, key: str, size: int, url: str, etag: str | None = None
    ) -> None:
        self._client, self._bucket, self._key, self._url = client, bucket, key, url
        self._size = size
        self._etag = etag
        self._pos = 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._pos

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self._pos, io.SEEK_END: self._size}[whence]
        self._pos = max(0, base + offset)
        return self._pos

    def readinto(self, buffer: Any) -> int:
        view = memoryview(buffer).cast("B")
        end = min(self._pos + len(view), self._size)
        if end <= self._pos:
            return 0
        from botocore.exceptions import BotoCoreError, ClientError

        condition = {"IfMatch": self._etag} if self._etag else {}
        try:
            response = self._client.get_object(
                Bucket=self._bucket,
                Key=self._key,
                Range=f"bytes={self._pos}-{end - 1}",
                **condition,
            )
            data: bytes = response["Body"].read()
        except ClientError as exc:
            status = exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode")
            if status == 412:
                raise InputError(
                    f"{self._url}: object changed while it was read (it was ETag "
                    f"{self._etag} when opened): read it again once it no longer changes"
                ) from exc
            raise _client_error(self._url, exc) from exc
        except BotoCoreError as exc:
            raise _client_error(self._url, exc) from exc
        if len(data) != end - self._pos:  # the object changed under us: never read a mix
            raise InputError(f"{self._url}: object changed while it was read")
        view[: len(data)] = data
        self._pos += len(data)
        return len(data)


class S3Path:
    """An object or a prefix in a bucket, addressed like a local path by the readers."""

    def __init__(self, client: Any, bucket: str, key: str) -> None:
        self._client = client
        self.bucket = bucket
        self.key = key.strip("/")

    @property
    def name(self) -> str:
        return self.key.rsplit("/", 1)[-1]

    def __str__(self) -> str:
        return f"s3://{self.bucket}/{self.key}"

    def __truediv__(self, child: str) -> S3Path:
        return S3Path(self._client, self.bucket, f"{self.key}/{child}" if self.key else child)

    def _head(self) -> int | None:
        """The object's size, or None when there is no object under exactly this key."""
        found = self._head_object()
        return None if found is None else int(found["ContentLength"])

    def _head_object(self) -> dict[str, Any] | None:
        """The object's HEAD response, or None when there is no object under this key."""
        from botocore.exceptions import BotoCoreError, ClientError

        if not self.key:
            return None
        try:
            head = self._client.head_object(Bucket=self.bucket, Key=self.key)
        except ClientError as exc:
            if exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode") == 404:
                return None
            raise _client_error(str(self), exc) from exc
        except BotoCoreError as exc:
            raise _client_error(str(self), exc) from exc
        found: dict[str, Any] = head
        return found

    def _children(self) -> list[str]:
        """Names of the objects directly under this prefix (not deeper), in name order."""
        from botocore.exceptions import BotoCoreError, ClientError

        prefix = f"{self.key}/" if self.key else ""
        names: list[str] = []
        try:
            pages = self._client.get_paginator("list_objects_v2").paginate(
                Bucket=self.bucket, Prefix=prefix, Delimiter="/"
            )
            for page in pages:
                names += [item["Key"][len(prefix) :] for item in page.get("Contents", [])]
        except (BotoCoreError, ClientError) as exc:
            raise _client_error(str(self), exc) from exc
        return sorted(name for name in names if name)

    def is_dir(self) -> bool:
        return self._head() is None and bool(self._children())

    def exists(self) -> bool:
        return self._head() is not None or bool(self._children())

    def glob(self, pattern: str) -> list[S3Path]:
        return [self / name for name in self._children() if fnmatch.fnmatchcase(name, pattern)]

    def open(self, mode: str = "rb") -> IO[bytes]:
        if mode != "rb":
            raise ValueError(f"S3 sources are read-only, not {mode!r}")
        head = self._head_object()
        if head is None:
            raise InputError(f"{self}: no such object")
        size, etag = int(head["ContentLength"]), head.get("ETag")
        raw = _RangedReader(self._client, self.bucket, self.key, size, str(self), etag)
        return io.BufferedReader(raw, buffer_size=CHUNK_BYTES)

    def read_bytes(self) -> bytes:
        with self.open() as handle:
            return handle.read()


SourcePath = Path | S3Path  # where a dataset is: on disk or in a bucket


def s3_source(url: str, endpoint_url: str | None, region: str) -> S3Path:
    """`s3://bucket/key` or `s3://bucket/prefix/` as a path the readers can walk."""
    bucket, _, key = url.removeprefix("s3://").partition("/")
    if not bucket:
        raise InputError(f"{url}: an S3 source is s3://bucket/key or s3://bucket/prefix/")
    return S3Path(s3_client(endpoint_url, region), bucket, key)
