"""An emulator engine process a test starts on its own (the `start_emulator` fixture)."""

from __future__ import annotations

import subprocess
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import httpx

from harness.waits import wait_for

EMULATOR_FAST_ENV = {
    "GENFLEET_EMULATOR_LOAD_S": "0",
    "GENFLEET_EMULATOR_WARMUP_S": "0",
    "GENFLEET_EMULATOR_TIME_SCALE": "100",
    "GENFLEET_EMULATOR_MEAN_COMPLETION_TOKENS": "40",
}


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
