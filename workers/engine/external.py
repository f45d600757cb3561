"""An engine someone else runs (`--engine external --engine-url`): health-checked, not owned."""

from __future__ import annotations

import collections
import time
from typing import Any

import httpx

from genfleet.common.errors import EngineDown
from genfleet.workers.engine.launch import auth_headers
from genfleet.workers.engine.supervisor import State


class ExternalEngine:
    """An engine someone else runs (`--engine external --engine-url`): checked, not supervised.

    Same surface as EngineSupervisor so the worker treats both alike; it cannot restart what
    it does not own, so `wait_up` polls health until the engine answers again or time runs out.
    """

    restarts = 0
    deaths = 0  # it cannot be watched dying: no prompt is ever blamed for it
    crashes = 0
    last_error: str | None = None
    log_tail: collections.deque[str] = collections.deque(maxlen=1)
    pid = None

    def __init__(self, base_url: str, health_path: str = "/health", api_key: str | None = None):
        self._base_url = base_url.rstrip("/")
        self.health_path = health_path
        self.api_key = api_key
        self.state: State = "stopped"
        self.server_info: dict[str, Any] = {}

    @property
    def base_url(self) -> str:
        return self._base_url

    def _headers(self) -> dict[str, str]:
        return auth_headers(self.api_key)

    def _healthy(self) -> bool:
        try:
            response = httpx.get(
                self._base_url + self.health_path, headers=self._headers(), timeout=10.0
            )
        except httpx.TransportError:
            return False
        return response.status_code == 200

    def alive(self) -> bool:
        return True  # not ours to watch: its failures are seen as connection errors

    def start(self, timeout_s: float = 60.0) -> dict[str, Any]:
        self.state = "starting"
        self.wait_up(timeout_s)
        return self.refresh_info()

    def wait_up(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while not self._healthy():
            if time.monotonic() > deadline:
                self.state = "restarting"
                raise EngineDown(f"external engine at {self._base_url} does not answer")
            time.sleep(1.0)
        self.state = "ready"

    def forgive(self, restarts: int) -> None:
        """Nothing to forgive: it is never restarted from here."""

    def refresh_info(self) -> dict[str, Any]:
        try:
            response = httpx.get(
                self._base_url + "/server_info", headers=self._headers(), timeout=10.0
            )
            if response.status_code == 200 and isinstance(response.json(), dict):
                self.server_info = response.json()
        except (httpx.TransportError, ValueError):
            pass
        return self.server_info

    def stop(self) -> None:
        self.state = "stopped"
