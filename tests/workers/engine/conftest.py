"""Start the engine emulator as a real subprocess on a free port, the way the supervisor does.

Readiness is polled against a deadline (never a fixed sleep); every process started here is
terminated at teardown.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import IO

import httpx
import pytest

REPO = Path(__file__).resolve().parents[3]
FAST_ENV = {
    "GENFLEET_EMULATOR_LOAD_S": "0",
    "GENFLEET_EMULATOR_WARMUP_S": "0",
    "GENFLEET_EMULATOR_TIME_SCALE": "100",
    "GENFLEET_EMULATOR_MEAN_COMPLETION_TOKENS": "40",
}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def wait_for(predicate: Callable[[], bool], timeout_s: float = 10.0, what: str = "") -> None:
    """Poll `predicate` until it holds or the deadline passes."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.01)
    raise AssertionError(f"timed out after {timeout_s} s waiting for {what or predicate}")


@dataclass
class Emulator:
    proc: subprocess.Popen[bytes]
    port: int
    log_path: Path

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def log(self) -> str:
        return self.log_path.read_text()

    def health_status(self) -> int | None:
        """The /health status code, or None while the port is closed."""
        try:
            return httpx.get(f"{self.base_url}/health", timeout=5).status_code
        except httpx.TransportError:
            return None

    def wait_ready(self, timeout_s: float = 15.0) -> None:
        wait_for(lambda: self.health_status() == 200, timeout_s, "/health 200")


StartEmulator = Callable[..., Emulator]


@pytest.fixture(scope="module")
def start_emulator(tmp_path_factory: pytest.TempPathFactory) -> Iterator[StartEmulator]:
    """`start_emulator(*flags, env={...}, ready=True)` → a running Emulator."""
    started: list[tuple[Emulator, IO[bytes]]] = []

    def start(*flags: str, env: dict[str, str] | None = None, ready: bool = True) -> Emulator:
        port = free_port()
        log_path = tmp_path_factory.mktemp("emulator") / "engine.log"
        log_file = log_path.open("wb")
        argv = [
            sys.executable,
            "-m",
            "genfleet.workers.engine.emulator",
            "--model-path",
            "test-model",
        ]
        argv += ["--port", str(port), *flags]
        proc = subprocess.Popen(
            argv,
            cwd=REPO,
            env={**os.environ, **FAST_ENV, **(env or {})},
            stdout=log_file,
            stderr=subprocess.STDOUT,
        )
        emulator = Emulator(proc, port, log_path)
        started.append((emulator, log_file))
        if ready:
            emulator.wait_ready()
        return emulator

    yield start
    for emulator, log_file in started:
        if emulator.proc.poll() is None:
            emulator.proc.terminate()
            try:
                emulator.proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                emulator.proc.kill()
                emulator.proc.wait()
        log_file.close()
