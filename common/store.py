"""The object store: `s3://bucket/prefix` through boto3, or `file:///path` for one machine.

Outputs are written once: `put_if_absent` returns False when the key already exists, so a
batch delivered twice (Redis visibility timeout, a reaped lease) is harmless by construction.
On S3 that is `PutObject` with `If-None-Match: *` (412 when the key exists); on a local
directory it is a hard link of a complete temporary file, which fails when the name exists.
"""

from __future__ import annotations

import builtins
import contextlib
import logging
import os
import secrets
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, TypeVar
from urllib.parse import unquote, urlparse

from genfleet.common.errors import ConfigError, StoreError, StoreUnavailable

if TYPE_CHECKING:
    from genfleet.common.settings import Settings

T = TypeVar("T")
log = logging.getLogger("genfleet.store")


class Store(Protocol):
    url: str

    def put_if_absent(self, key: str, data: bytes) -> bool:
        """Write `key` unless it exists; True when this call wrote it."""

    def put(self, key: str, data: bytes) -> None:
        """Write or overwrite `key` (manifests, reject lists, exports)."""

    def get(self, key: str) -> bytes | None:
        """The object's bytes, or None when it does not exist."""

    def exists(self, key: str) -> bool: ...

    def list(self, prefix: str) -> Iterator[str]:
        """Keys under `prefix`, in lexical order."""

    def delete_prefix(self, prefix: str) -> int: ...

    def folders(self) -> Sequence[str]:
        """The names of the top-level folders (one per run), without listing their objects."""


def new_temp_file(directory: Path, prefix: str) -> Path:
    """A new empty file in `directory` with the mode the umask gives any new file.

    `tempfile.mkstemp` makes 0600 files whatever the umask, and a file renamed into place keeps
    that mode: stores and exports shared with other users (or containers) must not.
    """
    for _ in range(100):  # 64 random bits: a clash means a stale temporary file at most
        path = directory / f"{prefix}{secrets.token_hex(8)}"
        with contextlib.suppress(FileExistsError):
            os.close(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666))
            return path
    raise StoreError(f"cannot create a temporary file in {directory}")


class FileStore:
    """A directory as a store; keys are relative paths. Atomic, write-once via hard links."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.url = root.as_uri()

    def _path(self, key: str) -> Path:
        path = (self.root / key).resolve()
        if self.root.resolve() not in path.parents:
            raise StoreError(f"key {key!r} escapes the store root")
        return path

    def _write_temp(self, path: Path, data: bytes, durable: bool) -> Path:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = new_temp_file(path.parent, ".tmp-")
        with tmp.open("wb") as handle:
            handle.write(data)
            if durable:
                handle.flush()
                os.fsync(handle.fileno())
        return tmp

    def put_if_absent(self, key: str, data: bytes) -> bool:
        # Outputs are what "done" means: make them durable before they become visible.
        path = self._path(key)
        tmp = self._write_temp(path, data, durable=True)
        try:
            os.link(tmp, path)
            return True
        except FileExistsError:
            return False
        finally:
            os.unlink(tmp)

    def put(self, key: str, data: bytes) -> None:
        path = self._path(key)
        tmp = self._write_temp(path, data, durable=False)
        os.replace(tmp, path)

    def get(self, key: str) -> bytes | None:
        try:
            return self._path(key).read_bytes()
        except FileNotFoundError:
            return None

    def exists(self, key: str) -> bool:
        return self._path(key).exists()

    def list(self, prefix: str) -> Iterator[str]:
        base = self.root / prefix
        directory = base if prefix.endswith("/") else base.parent
        if not directory.is_dir():
            return
        keys = []
        root = str(self.root)
        for dirpath, _dirnames, filenames in os.walk(directory):
            # String work, not a Path per file: a run's outputs are 100,000s of files.
            folder = os.path.relpath(dirpath, root).replace(os.sep, "/")
            head = "" if folder == "." else f"{folder}/"
            for name in filenames:
                if name.startswith(".tmp-"):
                    continue
                rel = head + name
                if rel.startswith(prefix):
                    keys.append(rel)
        yield from sorted(keys)

    def delete_prefix(self, prefix: str) -> int:
        self._path(prefix)  # the prefix is checked; the keys listed under it are the root's
        count = 0
        for key in list(self.list(prefix)):
            (self.root / key).unlink(missing_ok=True)
            count += 1
        return count

    def folders(self) -> Sequence[str]:
        return sorted(p.name for p in self.root.iterdir() if p.is_dir())


def s3_client(endpoint_url: str | None, region: str, deadline_s: float | None = None) -> Any:
    """A boto3 S3 client configured for any S3 server: the store's, and datasets read from S3.
    With `deadline_s`, its timeouts and retries fit inside it (see `call_timeouts`)."""
    try:
        import boto3
        from botocore.config import Config
    except ImportError as exc:  # pragma: no cover - boto3 is a base dependency
        raise ConfigError("s3:// URLs need boto3: pip install boto3") from exc
    connect_s, read_s, attempts = call_timeouts(deadline_s)
    config = Config(
        s3={"addressing_style": "path"},
        retries={"mode": "standard", "max_attempts": attempts},
        connect_timeout=connect_s,
        read_timeout=read_s,
        request_checksum_calculation="when_required",
        response_checksum_validation="when_required",
        max_pool_connections=32,
    )
    return boto3.client("s3", endpoint_url=endpoint_url, region_name=region, config=config)


class S3Store:
    """An S3 bucket (AWS, MinIO, moto, any S3 protocol server) under an optional prefix.

    Credentials come from the standard AWS variables only and are never logged. Path-style
    addressing for self-hosted servers; checksums only when required (botocore >= 1.36
    defaults break some S3-compatible servers); transient failures are retried with backoff
    here, then raised as StoreUnavailable so the caller's retry takes over.
    """

    def __init__(
        self,
        bucket: str,
        prefix: str,
        endpoint_url: str | None,
        region: str,
        attempts: int = 6,
        sleep: Callable[[float], None] = time.sleep,
        deadline_s: float | None = None,
    ) -> None:
        self.bucket = bucket
        self.prefix = prefix.strip("/")
        self.url = f"s3://{bucket}/{self.prefix}" if self.prefix else f"s3://{bucket}"
        self._attempts = attempts
        self._sleep = sleep
        self._deadline_s = deadline_s
        connect_s, read_s, _ = call_timeouts(deadline_s)
        self._try_s = connect_s + read_s
        self._client: Any = s3_client(endpoint_url, region, deadline_s)

    def _key(self, key: str) -> str:
        return f"{self.prefix}/{key}" if self.prefix else key

    def _call(self, what: str, fn: Callable[[], T]) -> T:
        from botocore.exceptions import BotoCoreError, ClientError

        delay = 0.5
        started = time.monotonic()
        for attempt in range(1, self._attempts + 1):
            try:
                return fn()
            except ClientError as exc:
                status = exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode", 0)
                code = exc.response.get("Error", {}).get("Code", "")
                retryable = status >= 500 or code in {"SlowDown", "ConditionalRequestConflict"}
                if not retryable:
                    raise
                error: Exception = exc
            except BotoCoreError as exc:  # connection refused, timeouts, DNS
                error = exc
            late = self._deadline_s is not None and (
                time.monotonic() - started + delay + self._try_s > self._deadline_s
            )
            if attempt == self._attempts or late:
                raise StoreUnavailable(f"S3 {what} failed after {attempt} tries: {error}")
            log.warning("S3 %s failed (%s); retry %d in %.1f s", what, error, attempt, delay)
            self._sleep(delay)
            delay = min(delay * 2, 10.0)
        raise AssertionError("unreachable")

    def put_if_absent(self, key: str, data: bytes) -> bool:
        from botocore.exceptions import ClientError

        def put() -> bool:
            try:
                self._client.put_object(
                    Bucket=self.bucket, Key=self._key(key), Body=data, IfNoneMatch="*"
                )
                return True
            except ClientError as exc:
                status = exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode", 0)
                if status == 412 or exc.response.get("Error", {}).get("Code") == (
                    "PreconditionFailed"
                ):
                    return False
                raise

        return self._call(f"put {key}", put)

    def put(self, key: str, data: bytes) -> None:
        self._call(
            f"put {key}",
            lambda: self._client.put_object(Bucket=self.bucket, Key=self._key(key), Body=data),
        )

    def get(self, key: str) -> bytes | None:
        from botocore.exceptions import ClientError

        def get() -> bytes | None:
            try:
                response = self._client.get_object(Bucket=self.bucket, Key=self._key(key))
            except ClientError as exc:
                if exc.response.get("Error", {}).get("Code") in {"NoSuchKey", "404"}:
                    return None
                raise
            body: bytes = response["Body"].read()
            return body

        return self._call(f"get {key}", get)

    def exists(self, key: str) -> bool:
        from botocore.exceptions import ClientError

        def head() -> bool:
            try:
                self._client.head_object(Bucket=self.bucket, Key=self._key(key))
                return True
            except ClientError as exc:
                status = exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode", 0)
                if status == 404:
                    return False
                raise

        return self._call(f"head {key}", head)

    def list(self, prefix: str) -> Iterator[str]:
        full = self._key(prefix)
        strip = len(self.prefix) + 1 if self.prefix else 0
        token: str | None = None
        while True:
            kwargs: dict[str, Any] = {"Bucket": self.bucket, "Prefix": full}
            if token:
                kwargs["ContinuationToken"] = token
            page = self._call(
                f"list {prefix}",
                lambda kw=kwargs: self._client.list_objects_v2(**kw),  # type: ignore[misc]
            )
            for item in page.get("Contents", []):
                yield item["Key"][strip:]
            if not page.get("IsTruncated"):
                return
            token = page.get("NextContinuationToken")

    def delete_prefix(self, prefix: str) -> int:
        count = 0
        for key in list(self.list(prefix)):
            self._call(
                f"delete {key}",
                lambda key=key: self._client.delete_object(  # type: ignore[misc]
                    Bucket=self.bucket, Key=self._key(key)
                ),
            )
            count += 1
        return count

    def folders(self) -> Sequence[str]:
        base = f"{self.prefix}/" if self.prefix else ""
        names: builtins.list[str] = []
        token: str | None = None
        while True:
            kwargs: dict[str, Any] = {"Bucket": self.bucket, "Prefix": base, "Delimiter": "/"}
            if token:
                kwargs["ContinuationToken"] = token
            page = self._call(
                "list folders",
                lambda kw=kwargs: self._client.list_objects_v2(**kw),  # type: ignore[misc]
            )
            for item in page.get("CommonPrefixes", []):
                names.append(item["Prefix"][len(base) :].rstrip("/"))
            if not page.get("IsTruncated"):
                return sorted(names)
            token = page.get("NextContinuationToken")


def call_timeouts(deadline_s: float | None) -> tuple[float, float, int]:
    """botocore's connect and read timeouts and its attempts for one store call.

    Without a deadline: 5 s, 60 s and 3 (a slow store is waited for). With one (a worker's
    store, bounded by its lease) one try takes at most a third of it and botocore does not
    retry on its own: `_call` retries while the deadline allows another whole try.

    >>> call_timeouts(30.0)
    (2.5, 7.5, 1)
    """
    if deadline_s is None:
        return 5.0, 60.0, 3
    connect_s = min(5.0, max(deadline_s / 12, 0.5))
    read_s = min(60.0, max(deadline_s / 3 - connect_s, 1.0))
    return connect_s, read_s, 1


def open_store(
    url: str,
    endpoint_url: str | None = None,
    region: str = "us-east-1",
    deadline_s: float | None = None,
) -> Store:
    """A store from its URL: `s3://bucket[/prefix]` or `file:///absolute/path`.

    `deadline_s` bounds each S3 call, retries included (see `call_timeouts`)."""
    parsed = urlparse(url)
    if parsed.scheme == "file":
        path = Path(unquote(parsed.netloc + parsed.path))
        if not path.is_absolute():
            raise ConfigError(f"file store path must be absolute: {url}")
        path.mkdir(parents=True, exist_ok=True)
        return FileStore(path)
    if parsed.scheme == "s3":
        if not parsed.netloc:
            raise ConfigError(f"s3 store URL needs a bucket: {url}")
        return S3Store(parsed.netloc, parsed.path, endpoint_url, region, deadline_s=deadline_s)
    raise ConfigError(f"store must be s3://bucket/prefix or file:///path, got {url!r}")


def store_of(settings: Settings, deadline_s: float | None = None) -> Store:
    """The store the settings name (`store`, `s3_endpoint_url`, `s3_region`): what every
    command and worker opens."""
    return open_store(settings.store, settings.s3_endpoint_url, settings.s3_region, deadline_s)
