"""The one local fleet of `genfleet run` on this host: a lock, held while any of it lives.

`genfleet run` takes the lock before it starts workers and hands it to each of them (the
file descriptor is inherited), so the lock is free again only when the command and every
worker it started have exited, however they ended. A second `genfleet run` finds it held and
refuses, rather than start a second fleet and a second beat on the same GPUs. The lock is an
`flock` on a file in this user's 0700 directory: the kernel releases it with the last process
holding it, so no stale pid file can keep a fleet from starting.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import time
from pathlib import Path

import orjson

from genfleet.common.errors import GenfleetError
from genfleet.common.private import open_private, private_dir


class FleetRunning(GenfleetError):
    """Another `genfleet run` (or the workers it left stopping) holds this host's fleet."""


class FleetLock:
    """`FleetLock.take(log_dir)`: held until `release()` and until every child given `fd`
    has exited."""

    def __init__(self, fd: int, path: Path) -> None:
        self.fd = fd
        self.path = path

    @classmethod
    def take(cls, log_dir: Path, root: Path | None = None) -> FleetLock:
        path = private_dir("run", root) / "fleet.lock"
        fd = open_private(path)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = _read(fd)
            os.close(fd)
            raise FleetRunning(
                "a local fleet is already running on this host"
                + (f" (genfleet run, pid {holder['pid']}" if holder.get("pid") else " (")
                + (f", logs in {holder['log_dir']})" if holder.get("log_dir") else ")")
                + ": wait for it to finish or stop it (Ctrl-C) before starting another; "
                "workers it started still stopping also hold it"
            ) from None
        os.ftruncate(fd, 0)
        os.pwrite(
            fd, orjson.dumps({"pid": os.getpid(), "log_dir": str(log_dir), "ts": time.time()}), 0
        )
        return cls(fd, path)

    def release(self) -> None:
        with contextlib.suppress(OSError):
            os.close(self.fd)


def _read(fd: int) -> dict[str, object]:
    try:
        data = orjson.loads(os.pread(fd, 4096, 0) or b"{}")
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}
