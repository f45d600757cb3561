"""Engine ports on this host: free, and reserved so two workers never pick the same one.

Lock files live in a directory of this user's own (`common/private.py`: 0700, checked to be a
real directory owned by this user, not a link someone planted in /tmp) and are opened without
following symlinks.
"""

from __future__ import annotations

import fcntl
import os
import socket
from pathlib import Path
from typing import IO

from genfleet.common.errors import EngineStartError
from genfleet.common.private import NotPrivate, open_private
from genfleet.common.private import private_dir as common_private_dir

__all__ = ["open_private", "pick_port", "port_is_free", "private_dir", "release_port"]


def port_is_free(host: str, port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except OSError:
            return False
        return True


_RESERVED: dict[int, IO[str]] = {}


def private_dir(name: str, root: Path | None = None) -> Path:
    """`common.private.private_dir`, its refusal an EngineStartError (the engine cannot start
    without its port locks and config file)."""
    try:
        return common_private_dir(name, root)
    except NotPrivate as exc:
        raise EngineStartError(str(exc)) from exc


def pick_port(host: str, preferred: int, span: int = 200) -> int:
    """`preferred` if it is free, else the next free port, reserved for this process.

    Checking that a port is free and the engine binding it are moments apart, so two workers
    starting together could pick the same one. Each pick therefore also takes an exclusive
    lock file for the port (released by `release_port` or when this process dies), and a
    port another worker has locked is skipped even before its engine listens.
    """
    lock_dir = private_dir("ports")
    for port in range(preferred, min(preferred + span, 65536)):
        if port in _RESERVED:
            continue
        try:
            handle = os.fdopen(open_private(lock_dir / f"{port}.lock"), "w")
        except OSError as exc:  # ELOOP: a symlink where a lock file should be
            raise EngineStartError(f"cannot open the lock of port {port}: {exc}") from exc
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            handle.close()
            continue
        if port_is_free(host, port):
            _RESERVED[port] = handle
            return port
        handle.close()
    raise EngineStartError(f"no free port in {preferred}..{preferred + span} on {host}")


def release_port(port: int) -> None:
    handle = _RESERVED.pop(port, None)
    if handle is not None:
        handle.close()
