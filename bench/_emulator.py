"""What the benchmarks share: a fresh emulator process with given knobs, and a metrics sampler.

Each client under test gets its own emulator started from the same argv and the same
GENFLEET_EMULATOR_* environment, so every one sees the same engine behaviour from a cold start.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Mapping
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def emulator_env(knobs: Mapping[str, str | float | int]) -> dict[str, str]:
    """The environment of a genfleet process: this one's, minus GENFLEET_*, plus `knobs`."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("GENFLEET_")}
    env["PYTHONPATH"] = str(ROOT)
    env.update({f"GENFLEET_{k.upper()}": str(v) for k, v in knobs.items()})
    return env


class Emulator:
    """The emulator (`-m genfleet.workers.engine.emulator`) on a free port; `stop()` ends it."""

    def __init__(
        self,
        knobs: Mapping[str, str | float | int],
        max_running_requests: int,
        argv: list[str] | None = None,
    ) -> None:
        """`argv` (an engine command line without --port) replaces the default flags."""
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        argv = (
            [*argv, "--port", str(self.port)]
            if argv
            else [
                sys.executable,
                "-m",
                "genfleet.workers.engine.emulator",
                "--model-path",
                "bench-model",
                "--port",
                str(self.port),
                "--max-running-requests",
                str(max_running_requests),
                "--reasoning-parser",
                "qwen3",
                "--enable-metrics",
                "--log-level",
                "warning",
            ]
        )
        self.proc = subprocess.Popen(
            argv,
            env=emulator_env(knobs),
            cwd=ROOT,
            start_new_session=True,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )

    def wait_ready(self, timeout_s: float = 60.0) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"emulator exited {self.proc.returncode}")
            try:
                if httpx.get(self.url + "/health", timeout=5).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.1)
        raise RuntimeError(f"emulator on {self.url} not ready after {timeout_s:.0f} s")

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()


def read_metric(text: str, name: str) -> float | None:
    """The value of `sglang:<name>` in a Prometheus exposition, or None."""
    prefix = f"sglang:{name}{{"
    for line in text.splitlines():
        if line.startswith(prefix):
            return float(line.rsplit(" ", 1)[1])
    return None


class Sampler:
    """Polls an engine's /metrics every `interval_s` on a thread of its own.

    Each sample is (wall-clock time, running requests, queued requests, generation tokens so
    far): enough for the fraction of time at the cap and tokens/s over any window.
    """

    def __init__(self, url: str, interval_s: float = 0.05) -> None:
        self.url = url + "/metrics"
        self.interval_s = interval_s
        self.samples: list[tuple[float, float, float, float]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="sampler", daemon=True)

    def start(self) -> Sampler:
        self._thread.start()
        return self

    def _run(self) -> None:
        with httpx.Client(timeout=5) as client:
            next_at = time.time()
            while not self._stop.is_set():
                try:
                    text = client.get(self.url).text
                except httpx.HTTPError:
                    text = ""
                now = time.time()
                running = read_metric(text, "num_running_reqs")
                if running is not None:
                    queued = read_metric(text, "num_queue_reqs") or 0.0
                    tokens = read_metric(text, "generation_tokens_total") or 0.0
                    self.samples.append((now, running, queued, tokens))
                next_at += self.interval_s
                self._stop.wait(max(0.0, next_at - time.time()))

    def stop(self) -> list[tuple[float, float, float, float]]:
        self._stop.set()
        self._thread.join(timeout=10)
        return self.samples


def forget_run(redis_url: str, run: str, queue: str) -> None:
    """Delete what one benchmark run left in Redis, and nothing else (the database is shared)."""
    import redis

    client = redis.Redis.from_url(redis_url)
    doomed = [queue, f"_kombu.binding.{queue}", f"_kombu.binding_permanent.{queue}"]
    for pattern in (
        f"genfleet:run:{run}:*",
        f"genfleet:lease:{run}:*",
        f"celery-task-meta-{run}.*",
    ):
        doomed += list(client.scan_iter(match=pattern, count=1000))
    for i in range(0, len(doomed), 1000):
        client.delete(*doomed[i : i + 1000])
    client.srem("genfleet:runs", run)
    client.srem("genfleet:queues", queue)
    fields = [
        f
        for f in client.hkeys("genfleet:running")
        if (f if isinstance(f, str) else f.decode()).startswith(f"{run}/")
    ]
    if fields:
        client.hdel("genfleet:running", *fields)
    client.close()
