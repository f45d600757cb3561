"""Start the engine emulator as a real subprocess on a free port, the way the supervisor does.

Readiness is polled against a deadline (never a fixed sleep); every process started here is
terminated at teardown.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from typing import IO

import pytest

from harness.env import ROOT, free_port
from tests.support.emulator import EMULATOR_FAST_ENV, Emulator, StartEmulator


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
            cwd=ROOT,
            env={**os.environ, **EMULATOR_FAST_ENV, **(env or {})},
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
