"""The compose stack for real: Docker, Compose v2, the project's images, `up --wait`, `down -v`.

Runs only when selected (`python3 -m pytest -m compose tests/compose`): it installs Docker,
builds images and keeps both cores busy for minutes. One stack serves the whole session; it is
torn down with `down -v` whatever happened, and a `dockerd` started here is stopped. Seconds
per phase go to `$GENFLEET_COMPOSE_CACHE/timings.json` (default ~/.cache/genfleet-compose).
"""

from __future__ import annotations

import os
import shutil
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.compose import dockerhost
from tests.compose.dockerhost import DockerUnavailable, timed
from tests.compose.stack import PRODUCER_UID, Stack, remove_stale_projects


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
