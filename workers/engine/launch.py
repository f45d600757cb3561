"""What the supervisor starts: a command, its environment and where it will answer.

Builders (SGLang's argv, the emulator, a user's command) are pure functions from settings to
an EngineLaunch; the supervisor only knows how to run one.
"""

from __future__ import annotations

import shlex
from dataclasses import dataclass, field


def auth_headers(api_key: str | None) -> dict[str, str]:
    """The engine's API key as a bearer header (every call to an engine that has a key)."""
    return {"Authorization": f"Bearer {api_key}"} if api_key else {}


@dataclass(frozen=True)
class EngineLaunch:
    """A ready-to-spawn engine: argv, the environment it adds, and its loopback address."""

    kind: str  # "sglang" | "emulator" | "command"
    argv: list[str]
    env: dict[str, str] = field(default_factory=dict)
    host: str = "127.0.0.1"
    port: int = 30000
    health_path: str = "/health"
    api_key: str | None = None  # sent as a bearer token; never printed

    @property
    def base_url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def describe(self) -> str:
        """The command line as a shell would take it, with the API key masked."""
        argv = list(self.argv)
        for i, arg in enumerate(argv[:-1]):
            if arg == "--api-key":
                argv[i + 1] = "***"
        env = " ".join(f"{k}={shlex.quote(v)}" for k, v in sorted(self.env.items()))
        cmd = shlex.join(argv)
        return f"{env} {cmd}" if env else cmd
