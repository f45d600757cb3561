"""What tests share besides fixtures (those are in conftest.py): ports, waits, the environment
of a test's genfleet processes, worker and emulator processes, S3 buckets.

Redis: the server on 127.0.0.1:6379 (GENFLEET_TEST_REDIS_URL overrides), one database dedicated
to tests. Workers: `python -m genfleet.workers worker` processes with the emulator, started
through the same supervisor code path as SGLang.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

ROOT = Path(__file__).resolve().parent.parent
TEST_REDIS_URL = os.environ.get("GENFLEET_TEST_REDIS_URL", "redis://127.0.0.1:6379/11")


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def wait_for(
    condition: Callable[[], Any], timeout_s: float, what: str, interval_s: float = 0.1
) -> Any:
    """Poll `condition` until it returns a truthy value; fail naming `what` at the deadline."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = condition()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s:.0f} s waiting for {what}")
        time.sleep(interval_s)


def dummy_aws_credentials() -> None:
    os.environ.setdefault("AWS_ACCESS_KEY_ID", "testing")
    os.environ.setdefault("AWS_SECRET_ACCESS_KEY", "testing")
    os.environ.setdefault("AWS_DEFAULT_REGION", "us-east-1")


def new_bucket(endpoint_url: str) -> str:
    """A fresh bucket on the server; returns its store URL, `s3://BUCKET/runs`."""
    import boto3

    bucket = f"genfleet-{uuid.uuid4().hex[:12]}"
    client = boto3.client("s3", endpoint_url=endpoint_url, region_name="us-east-1")
    client.create_bucket(Bucket=bucket)
    return f"s3://{bucket}/runs"


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
    env.update({f"GENFLEET_{k.upper()}": str(v) for k, v in extra.items()})
    return env


@contextlib.contextmanager
def control_app(broker_url: str) -> Iterator[Any]:
    """A bare Celery app on `broker_url` for remote control (ping, inspect) of test workers."""
    from celery import Celery

    app = Celery("genfleet-test", broker=broker_url, set_as_current=False)
    app.conf.broker_connection_retry_on_startup = True
    try:
        yield app
    finally:
        app.close()


def answering(broker_url: str, hostnames: list[str], timeout_s: float = 0.5) -> set[str]:
    """Which of the Celery workers `hostnames` answer a ping on `broker_url` now.

    A genfleet worker answers only once it consumes, and it consumes only after its engine
    step started the engine and the engine served (the consumer is the last worker step), so
    an answer means ready.
    """
    with control_app(broker_url) as app:
        replies = app.control.ping(destination=hostnames, timeout=timeout_s)
    return {name for reply in replies for name in reply} & set(hostnames)


def worker_report(broker_url: str, hostname: str, timeout_s: float = 1.0) -> dict[str, Any]:
    """Worker `hostname`'s `gpu_report` inspect reply now (its telemetry window, its engine
    state, its recent findings); {} when it does not answer."""
    with control_app(broker_url) as app:
        inspect = app.control.inspect(destination=[hostname], timeout=timeout_s)
        replies = inspect._request("gpu_report") or {}
    report: dict[str, Any] = replies.get(hostname) or {}
    return report


def engine_report(broker_url: str, hostname: str, timeout_s: float = 1.0) -> dict[str, Any]:
    """The engine state (`EngineState` JSON) worker `hostname` reports now; {} when it does
    not answer or has no sample yet."""
    engine: dict[str, Any] = worker_report(broker_url, hostname, timeout_s).get("engine") or {}
    return engine


class Worker:
    """A real `python -m genfleet.workers worker` process (with its emulator engine)."""

    def __init__(self, env: dict[str, str], log: Path, hostname: str, args: list[str]) -> None:
        self.hostname = hostname
        self.log = log
        self.broker_url = env["GENFLEET_REDIS_URL"]
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "genfleet.workers", *args, "--hostname", hostname],
            env=env,
            cwd=ROOT,
            stdout=log.open("ab"),
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )

    def wait_ready(self, timeout_s: float = 60.0) -> None:
        def ready() -> bool:
            if self.proc.poll() is not None:
                raise AssertionError(f"worker exited {self.proc.returncode}:\n{self.tail()}")
            return self.hostname in answering(self.broker_url, [self.hostname])

        wait_for(ready, timeout_s, f"worker {self.hostname} to be ready", 0.2)

    def tail(self, lines: int = 40) -> str:
        return "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:])

    def kill(self, sig: int = signal.SIGKILL) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.kill(self.proc.pid, sig)

    def stop(self, timeout_s: float = 30.0) -> None:
        if self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.proc.pid, signal.SIGKILL)  # whatever is left of the worker's group


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


def corrupt_parquet(path: Path, rows: int, group_rows: int, bad_group: int) -> Path:
    """A Parquet file of `rows` prompts whose row group `bad_group` has its data pages
    overwritten (a file corrupt mid-file)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    table = pa.Table.from_pylist(
        [{"id": f"p{i:04d}", "prompt": f"question number {i} " * 5} for i in range(rows)]
    )
    pq.write_table(table, path, row_group_size=group_rows)
    data = bytearray(path.read_bytes())
    for column in range(2):
        offset = pq.ParquetFile(path).metadata.row_group(bad_group).column(column).data_page_offset
        data[offset : offset + 40] = b"\xff" * 40
    path.write_bytes(bytes(data))
    return path
