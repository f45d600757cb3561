"""The dry-run stack of compose.yaml, run without Docker, completes a small run end to end.

Every process is started from its service's own entrypoint, command and environment as
compose.yaml writes them: the bucket job, `worker-dry`, `beat`, and the producer for enqueue,
status and export; readiness is the services' own healthchecks. What .env would hold comes
from the test: Redis and S3 are this machine's test Redis and a moto S3 server, reached the
way a worker on a second node reaches the main one (GENFLEET_REDIS_URL,
GENFLEET_S3_ENDPOINT_URL).
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import IO, Any

import boto3
import orjson
import pytest

from harness.env import ROOT
from harness.waits import wait_for
from tests.support.compose_file import argv, interpolate, load_compose, seconds, service_environment

pytestmark = [pytest.mark.integration, pytest.mark.slow]


def host_env(redis_url: str, s3_endpoint: str, bucket: str) -> dict[str, str]:
    """What .env and the shell hold for compose, pointed at the test's Redis and S3."""
    return {
        "REDIS_PASSWORD": "unused-with-GENFLEET_REDIS_URL",
        "S3_ACCESS_KEY_ID": "testing",
        "S3_SECRET_ACCESS_KEY": "testing",
        "S3_BUCKET": bucket,
        "FLOWER_BASIC_AUTH": "ops:pw",
        "GENFLEET_REDIS_URL": redis_url,
        "GENFLEET_S3_ENDPOINT_URL": s3_endpoint,
        "GENFLEET_BATCH_SIZE": "10",
        "GENFLEET_MAX_TOKENS": "1024",
        "GENFLEET_EMULATOR_TIME_SCALE": "200",
        "GENFLEET_EMULATOR_MEAN_COMPLETION_TOKENS": "200",
        "GENFLEET_EMULATOR_MAX_COMPLETION_TOKENS": "1024",
        "GENFLEET_EMULATOR_LOAD_S": "0.2",
        "GENFLEET_EMULATOR_WARMUP_S": "0.2",
    }


def program(name: str) -> str:
    """`python3`, `genfleet`, `celery` as installed for the interpreter running the tests."""
    if name.startswith("python"):
        return sys.executable
    beside = Path(sys.executable).parent / name
    found = str(beside) if beside.exists() else shutil.which(name)
    assert found, f"{name} is not installed"
    return found


class Stack:
    """The service processes of one test; all stopped (process groups included) at the end."""

    def __init__(self, tmp_path: Path, env: Mapping[str, str]) -> None:
        self.tmp_path = tmp_path
        self.env = env
        self.services: dict[str, Any] = load_compose()["services"]
        self.procs: dict[str, subprocess.Popen[bytes]] = {}
        self.logs: list[IO[bytes]] = []

    def process_env(self, service: str) -> dict[str, str]:
        """A container's environment: the service's variables and little else."""
        base = {
            "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}",
            "HOME": str(self.tmp_path),
            "TMPDIR": str(self.tmp_path),
            "PYTHONPATH": str(ROOT),
            "HOSTNAME": socket.gethostname(),
        }
        return {**base, **service_environment(self.services[service], self.env)}

    def command(self, service: str, *args: str) -> list[str]:
        parts = [interpolate(part, self.env) for part in argv(self.services[service])]
        if args:  # `docker compose run SERVICE ARGS…` replaces the command
            entrypoint = self.services[service]["entrypoint"]
            parts = parts[: len(entrypoint)] + list(args)
        return [program(parts[0]), *parts[1:]]

    def run(self, service: str, *args: str, timeout_s: float = 60) -> str:
        result = subprocess.run(
            self.command(service, *args),
            env=self.process_env(service),
            cwd=self.tmp_path,
            capture_output=True,
            timeout=timeout_s,
            check=False,
        )
        output = (result.stdout + result.stderr).decode(errors="replace")
        assert result.returncode == 0, (
            f"{service} {' '.join(args)} exited {result.returncode}:\n{output}"
        )
        return result.stdout.decode()

    def start(self, service: str) -> None:
        log = (self.tmp_path / f"{service}.log").open("ab")
        self.logs.append(log)
        self.procs[service] = subprocess.Popen(
            self.command(service),
            env=self.process_env(service),
            cwd=self.tmp_path,
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )

    def healthy(self, service: str) -> bool:
        """The service's compose healthcheck, run the way Docker runs it."""
        proc = self.procs[service]
        if proc.poll() is not None:
            raise AssertionError(f"{service} exited {proc.returncode}:\n{self.tail(service)}")
        kind, *test = self.services[service]["healthcheck"]["test"]
        parts = [interpolate(part, self.env) for part in test]
        command = ["/bin/sh", "-c", parts[0]] if kind == "CMD-SHELL" else parts
        if kind == "CMD":
            command[0] = program(command[0])
        result = subprocess.run(
            command, env=self.process_env(service), capture_output=True, timeout=60, check=False
        )
        return result.returncode == 0

    def tail(self, service: str, lines: int = 40) -> str:
        text = (self.tmp_path / f"{service}.log").read_text(errors="replace")
        return "\n".join(text.splitlines()[-lines:])

    def stop(self, *services: str) -> None:
        """`docker compose stop`: SIGTERM to each main process, then its stop_grace_period."""
        started = time.monotonic()
        for service in services:
            self.procs[service].send_signal(signal.SIGTERM)
        for service in services:
            grace_s = seconds(self.services[service].get("stop_grace_period", "10s"))
            try:
                self.procs[service].wait(timeout=max(started + grace_s - time.monotonic(), 0))
            except subprocess.TimeoutExpired:
                raise AssertionError(
                    f"{service} still running {grace_s:.0f} s after SIGTERM:\n{self.tail(service)}"
                ) from None

    def kill_all(self) -> None:
        for proc in self.procs.values():
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        for log in self.logs:
            log.close()


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


@pytest.fixture
def stack(tmp_path: Path, redis_url: str, s3_server: str) -> Iterator[tuple[Stack, str]]:
    bucket = f"dry-run-{uuid.uuid4().hex[:12]}"
    running = Stack(tmp_path, host_env(redis_url, s3_server, bucket))
    yield running, bucket
    running.kill_all()


def test_dry_run_stack_completes_a_run(stack: tuple[Stack, str], s3_server: str) -> None:
    running, bucket = stack
    # The one-shot bucket job creates the bucket, and a second start is harmless.
    assert "created bucket" in running.run("bucket-init")
    assert "exists" in running.run("bucket-init")
    boto3.client("s3", endpoint_url=s3_server, region_name="us-east-1").head_bucket(Bucket=bucket)

    running.start("worker-dry")
    running.start("beat")
    wait_for(lambda: running.healthy("worker-dry"), 120, "worker-dry to be healthy", 1.0)
    wait_for(lambda: running.healthy("beat"), 120, "beat to be healthy", 1.0)

    data = running.tmp_path / "data"
    data.mkdir()
    ids = [f"p{i:03d}" for i in range(50)]
    (data / "prompts.jsonl").write_bytes(
        b"".join(orjson.dumps({"id": i, "prompt": f"Say {i}."}) + b"\n" for i in ids)
    )
    running.run("producer", "enqueue", str(data / "prompts.jsonl"), "--run", "dry")

    def done() -> dict[str, Any] | None:
        for service in ("worker-dry", "beat"):
            assert running.procs[service].poll() is None, running.tail(service)
        report: dict[str, Any] = orjson.loads(running.run("producer", "status", "dry", "--json"))
        assert report["state"] != "failed", report
        return report if report["state"] == "done" else None

    report = wait_for(done, 180, "run dry to finish", 1.0)
    assert (report["prompts_done"], report["batches_total"]) == (50, 5)

    out = data / "dry.jsonl"
    running.run("producer", "export", "dry", "--out", str(out))
    rows = [orjson.loads(line) for line in out.read_bytes().splitlines()]
    assert [row["id"] for row in rows] == ids  # every prompt, once, in input order
    assert {row["engine"]["kind"] for row in rows} == {"emulator"}
    assert all(row["error"] is None for row in rows)

    # `docker compose stop`: both leave within their stop_grace_period, the engine with them.
    engine = re.search(r"engine ready at \S+ \(pid (\d+)\)", running.tail("worker-dry", 10_000))
    assert engine, running.tail("worker-dry")
    running.stop("worker-dry", "beat")
    wait_for(lambda: not alive(int(engine.group(1))), 10, "the engine to stop with its worker")
