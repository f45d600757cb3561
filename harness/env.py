"""Where a test's genfleet processes run: the checkout, this test process's Redis database and
engine ports, and the environment they start with.

Redis: the server on 127.0.0.1:6379, one database dedicated to tests (11, or the one
GENFLEET_TEST_REDIS_URL names; one per xdist worker in a parallel run: `redis_url_for_tests`).
"""

from __future__ import annotations

import os
import socket
import urllib.parse
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]


def xdist_index() -> int | None:
    """This pytest-xdist worker's number (`gw3` → 3), or None outside a parallel run."""
    worker = os.environ.get("PYTEST_XDIST_WORKER", "")
    return int(worker[2:]) if worker.startswith("gw") and worker[2:].isdigit() else None


def redis_url_for_tests() -> str:
    """The Redis database of this test process, flushed before and after each test that uses it.

    GENFLEET_TEST_REDIS_URL names it (default database 11). In a parallel run each xdist worker
    gets a database of its own, `gwN` the Nth after the first: the named one, or 12 by default,
    so that a serial run (11) and a parallel one on the same machine never flush each other's.
    """
    named = os.environ.get("GENFLEET_TEST_REDIS_URL")
    index = xdist_index()
    if index is None:
        return named or "redis://127.0.0.1:6379/11"
    base = urllib.parse.urlsplit(named or "redis://127.0.0.1:6379/12")
    first = int(base.path.strip("/") or 0)
    return urllib.parse.urlunsplit(base._replace(path=f"/{first + index}"))


TEST_REDIS_URL = redis_url_for_tests()


def engine_port_base() -> int:
    """Where this test process's engines start looking for a port: SGLang's 30000, 1000 on
    per xdist worker (port locks are per private directory, and each xdist worker has its
    own: conftest.py)."""
    return 30000 + 1000 * (xdist_index() or 0)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def base_env(redis_url: str, store: str, **extra: Any) -> dict[str, str]:
    """The environment of a test's genfleet processes: fast emulator, short leases."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("GENFLEET_")}
    env.update(
        {
            "GENFLEET_REDIS_URL": redis_url,
            "GENFLEET_STORE": store,
            "GENFLEET_EMULATOR_TIME_SCALE": "200",
            "GENFLEET_EMULATOR_LOAD_S": "0.2",
            "GENFLEET_EMULATOR_WARMUP_S": "0.2",
            "GENFLEET_EMULATOR_MEAN_COMPLETION_TOKENS": "200",
            "GENFLEET_EMULATOR_MAX_COMPLETION_TOKENS": "1024",
            "GENFLEET_MAX_TOKENS": "1024",
            "GENFLEET_STARTUP_TIMEOUT_S": "60",
            "GENFLEET_RESTART_BACKOFF_S": "0.2",
            # a test's workers stop within seconds, handing unfinished batches back
            "GENFLEET_SHUTDOWN_GRACE_S": "1",
            "PYTHONPATH": str(ROOT),
        }
    )
    if xdist_index() is not None:
        env["GENFLEET_PORT"] = str(engine_port_base())
    env.update({f"GENFLEET_{k.upper()}": str(v) for k, v in extra.items()})
    return env
