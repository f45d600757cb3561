"""Engine ports on this host: free, and reserved so two workers never pick the same one."""

from __future__ import annotations

import fcntl
import socket
import tempfile
from pathlib import Path
from typing import IO

from genfleet.common.errors import EngineStartError


def port_is_free(host: str, port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except OSError:
            return False
        return True


_RESERVED: dict[int, IO[str]] = {}


def pick_port(host: str, preferred: int, span: int = 200) -> int:
    """`preferred` if it is free, else the next free port, reserved for this process.

    Checking that a port is free and the engine binding it are moments apart, so two workers
    starting together could pick the same one. Each pick therefore also takes an exclusive
    lock file for the port (released by `release_port` or when this process dies), and a
    port another worker has locked is skipped even before its engine listens.
    """
    lock_dir = Path(tempfile.gettempdir()) / "genfleet-ports"
    lock_dir.mkdir(parents=True, exist_ok=True)
    for port in range(preferred, min(preferred + span, 65536)):
        if port in _RESERVED:
            continue
        handle = (lock_dir / f"{port}.lock").open("w")
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
