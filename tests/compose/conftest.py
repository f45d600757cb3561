"""The compose stack for real: Docker, Compose v2, the project's images, `up --wait`, `down -v`.

Runs only when selected (`python3 -m pytest -m compose tests/compose`): it installs Docker,
builds images and keeps both cores busy for minutes. One stack serves the whole session; it is
torn down with `down -v` whatever happened, and a `dockerd` started here is stopped. Seconds
per phase go to `$GENFLEET_COMPOSE_CACHE/timings.json` (default ~/.cache/genfleet-compose).
"""

from __future__ import annotations

import json
import os
import re
import secrets
import shutil
import subprocess
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.compose import dockerhost
from tests.compose.dockerhost import DockerUnavailable, docker_env, log, run, timed
from tests.support import free_port, wait_for

ROOT = Path(__file__).resolve().parents[2]
PRODUCER_UID = 1000  # HOST_UID/HOST_GID: the slim image's own user owns the data folder


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Compose tests run when `-m` names them, never as a side effect of the whole suite."""
    if "compose" in (config.option.markexpr or ""):
        return
    skip = pytest.mark.skip(reason="the compose harness runs on its own: pytest -m compose")
    for item in items:
        if item.get_closest_marker("compose"):
            item.add_marker(skip)


@pytest.fixture(scope="session")
def docker_engine() -> Iterator[str]:
    """An engine with Compose v2 and the stand-in base images; skips only if Docker can't run."""
    started = time.monotonic()
    try:
        dockerhost.prepare()
        engine = dockerhost.docker_engine()
        version = engine.__enter__()
    except DockerUnavailable as exc:
        pytest.skip(f"Docker cannot run here: {exc}")
    try:
        timed("engine_ready", started)
        started = time.monotonic()
        dockerhost.ensure_standins()
        timed("standin_images", started)
        yield version
    finally:
        engine.__exit__(None, None, None)


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


@pytest.fixture(scope="session")
def stack(docker_engine: str) -> Iterator[Stack]:
    """genfleet's images built from the Dockerfile, then `up -d --wait`; `down -v` at the end."""
    workdir = Path(tempfile.mkdtemp(prefix="genfleet-compose-"))
    workdir.chmod(0o755)
    stack = Stack(workdir)
    stack.data.mkdir()
    os.chown(stack.data, PRODUCER_UID, PRODUCER_UID)
    try:
        remove_stale_projects()
        started = time.monotonic()
        # one service builds the slim image; the others use the same tag
        stack.compose("build", "worker-dry", timeout_s=600)
        timed("genfleet_images", started)
        started = time.monotonic()
        try:
            stack.compose("up", "-d", "--wait", timeout_s=300)
        except AssertionError as exc:
            raise AssertionError(f"{exc}\n{stack.diagnostics()}") from exc
        timed("up_wait", started)
        yield stack
    finally:
        started = time.monotonic()
        stack.compose("--profile", "tools", "down", "-v", "--remove-orphans", check=False)
        timed("down", started)
        shutil.rmtree(workdir, ignore_errors=True)
