"""One compose project of the dry-run profile (`Stack`) and what it is started with: its `.env`
and the environment `docker compose` runs in. The fixture that builds and starts it is in
conftest.py."""

from __future__ import annotations

import json
import re
import secrets
import subprocess
from pathlib import Path
from typing import Any

from harness.env import ROOT, free_port
from harness.waits import wait_for
from tests.compose.dockerhost import docker_env, log, run

PRODUCER_UID = 1000  # HOST_UID/HOST_GID: the slim image's own user owns the data folder


class Stack:
    """One compose project of the dry-run profile, driven through the `docker compose` CLI."""

    def __init__(self, workdir: Path) -> None:
        self.workdir = workdir
        self.data = workdir / "data"
        self.project = f"genfleet-test-{secrets.token_hex(3)}"
        self.env_file = workdir / ".env"
        self.settings = write_env(self.env_file, self.data)

    def compose(
        self, *args: str, timeout_s: float = 120, check: bool = True
    ) -> subprocess.CompletedProcess[str]:
        argv = ["docker", "compose", "--project-directory", str(ROOT), "-f"]
        argv += [str(ROOT / "compose.yaml"), "--env-file", str(self.env_file), "-p", self.project]
        return run(argv + ["--profile", "dry-run", *args], timeout_s, compose_env(), check)

    def producer(
        self, *args: str, timeout_s: float = 120, check: bool = True
    ) -> subprocess.CompletedProcess[str]:
        """`docker compose run --rm producer ARGS` (its dependencies are already up)."""
        return self.compose(
            "run", "--rm", "--no-deps", "-T", "producer", *args, timeout_s=timeout_s, check=check
        )

    def status(self, run_name: str) -> dict[str, Any]:
        report: dict[str, Any] = json.loads(self.producer("status", run_name, "--json").stdout)
        return report

    def wait_done(self, run_name: str, timeout_s: float) -> dict[str, Any]:
        def done() -> dict[str, Any] | None:
            report = self.status(run_name)
            assert report["state"] != "failed", report
            return report if report["state"] == "done" else None

        report: dict[str, Any] = wait_for(done, timeout_s, f"run {run_name} to finish", 1.0)
        return report

    def diagnostics(self) -> str:
        parts = [
            self.compose("ps", "-a", check=False).stdout,
            self.compose("logs", "--no-color", "--tail", "40", check=False).stdout[-8000:],
        ]
        return "\n".join(parts)


def compose_env() -> dict[str, str]:
    """The environment for `docker compose`, without the variables compose.yaml reads.

    Compose takes a variable from the shell before `.env`: this process's own GENFLEET_…
    (tests/conftest.py points GENFLEET_REDIS_URL at the test Redis) or AWS_… variables would
    silently override the stack's.
    """
    names = set(re.findall(r"\$\{?([A-Za-z_][A-Za-z0-9_]*)", (ROOT / "compose.yaml").read_text()))
    return {
        key: value
        for key, value in docker_env().items()
        if key not in names and not key.startswith(("GENFLEET_", "AWS_", "COMPOSE_"))
    }


def remove_stale_projects() -> None:
    """Projects of an interrupted earlier session: their restart policy would revive them."""
    listing = run(["docker", "compose", "ls", "-a", "--format", "json"], 60, docker_env())
    for project in json.loads(listing.stdout or "[]"):
        if project["Name"].startswith("genfleet-test-"):
            log(f"removing stale project {project['Name']}")
            run(
                ["docker", "compose", "-p", project["Name"], "down", "-v", "--remove-orphans"],
                180,
                docker_env(),
                check=False,
            )


def write_env(path: Path, data: Path) -> dict[str, str]:
    """`.env` from `.env.example`: random secrets, the dry-run profile, free host ports."""
    settings: dict[str, str] = {}
    for line in (ROOT / ".env.example").read_text().splitlines():
        if line.strip() and not line.lstrip().startswith("#"):
            key, _, value = line.partition("=")
            settings[key.strip()] = value.strip()
    for key, value in settings.items():
        if "change-me" in value:
            settings[key] = value.replace("change-me", secrets.token_hex(16))
    settings.update(
        COMPOSE_PROFILES="dry-run",
        IMAGE_TAG="compose-test",
        DATA_DIR=str(data),
        HOST_UID=str(PRODUCER_UID),
        HOST_GID=str(PRODUCER_UID),
        MODEL_DIR=str(data / "models"),
        REDIS_PORT=str(free_port()),
        S3_PORT=str(free_port()),
        FLOWER_PORT=str(free_port()),
        GENFLEET_BATCH_SIZE="5",
        GENFLEET_SHUTDOWN_GRACE_S="3",
        GENFLEET_EMULATOR_TIME_SCALE="20",
    )
    path.write_text("".join(f"{key}={value}\n" for key, value in settings.items()))
    path.chmod(0o600)
    return settings
