"""A chaos soak: one run on a small fleet while a seeded random schedule breaks things.

The fleet: a private redis-server (AOF on), a moto S3 reached through a proxy that can be cut,
the control worker and two GPU workers with emulator engines. The schedule mixes worker
SIGKILLs (a new worker takes the dead one's place), engine SIGKILLs, engine SIGSTOPs (the stall
watchdog's case), Redis client kills, one Redis restart and S3 outages. The run must finish by
itself with every prompt exactly once and no batch parked. `tests/faults/test_chaos.py` runs it
as a test, `bench/chaos.py` against a fault-free run of the same data.
"""

from __future__ import annotations

import contextlib
import os
import random
import signal
import tempfile
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import redis

from genfleet.common.settings import Settings
from harness.assertions import assert_exactly_once
from harness.env import base_env, free_port
from harness.processes import Worker, engine_pid
from harness.runs import fault_settings, open_run_store, stage
from harness.services import FlakyProxy, RedisServer
from harness.sources import write_prompts

ACTIONS = ("kill_worker", "kill_engine", "stop_engine", "kill_clients", "s3_outage")
WORKER_SETTINGS: dict[str, Any] = {
    "emulator_time_scale": 1,
    "emulator_mean_completion_tokens": 300,
    "checkpoint_interval_s": 2,
    "lease_ttl_s": 4,
    "reaper_interval_s": 1,
    "engine_stall_timeout_s": 8,
    "restart_budget": 50,
    "batch_retries": 20,
    # Faults land on whatever runs: a batch may be on a killed worker more than the default
    # three times without being poison.
    "max_deliveries": 10,
}


def schedule(seed: int, duration_s: float, mean_gap_s: float) -> list[tuple[float, str]]:
    """(seconds from the start, action) pairs; one Redis restart in the middle third."""
    rng = random.Random(seed)
    plan: list[tuple[float, str]] = []
    at = rng.uniform(2.0, mean_gap_s)
    while at < duration_s:
        plan.append((round(at, 1), rng.choice(ACTIONS)))
        at += rng.expovariate(1.0 / mean_gap_s)
    plan.append((round(rng.uniform(duration_s / 3, 2 * duration_s / 3), 1), "restart_redis"))
    return sorted(plan)


@dataclass(frozen=True)
class Played:
    """A fault as played: when (wall clock), what, and the worker it hit (None: the whole
    fleet, or no worker: Redis, S3, a producer)."""

    at_s: float
    action: str
    target: str | None = None


@dataclass
class Fleet:
    """The services and processes of one soak; `close()` stops them all."""

    root: Path
    redis: RedisServer
    proxy: FlakyProxy
    s3_direct: str
    store_url: str
    workers: list[Worker] = field(default_factory=list)
    control: Worker | None = None
    stopped: list[int] = field(default_factory=list)  # SIGSTOPped engines, resumed at close
    log: list[str] = field(default_factory=list)
    played: list[Played] = field(default_factory=list)
    # More environment for worker `hostname` (the soak's request logs and poison prompt).
    extra_env: Callable[[str], dict[str, str]] | None = None

    def env(self, hostname: str) -> dict[str, str]:
        """The environment of worker `hostname`."""
        values = base_env(
            self.redis.url,
            self.store_url,
            s3_endpoint_url=self.proxy.url,
            log_dir=self.root,
            port=free_port(),
            **WORKER_SETTINGS,
        )
        return {**values, **(self.extra_env(hostname) if self.extra_env else {})}

    def start_worker(self, role: str = "worker") -> Worker:
        hostname = f"{role}-{uuid.uuid4().hex[:6]}@chaos"
        worker = Worker(self.env(hostname), self.root / f"{hostname}.log", hostname, [role])
        if role == "control":
            self.control = worker
        else:
            self.workers.append(worker)
        return worker

    def settings(self) -> Settings:
        """The producer's view, straight to S3 (never cut)."""
        return fault_settings(self.redis.url, self.store_url, s3_endpoint_url=self.s3_direct)

    def act(self, action: str, rng: random.Random) -> None:
        at_s = time.time()
        target: str | None = None
        live = [w for w in self.workers if w.proc.poll() is None]
        if action == "kill_worker" and live:
            victim = rng.choice(live)
            target = victim.hostname
            victim.kill(signal.SIGKILL)
            victim.proc.wait(timeout=10)
            self.start_worker()
        elif action in ("kill_engine", "stop_engine") and live:
            hit = rng.choice(live)
            target = hit.hostname
            pid = engine_pid(hit)
            if pid is not None:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL if action == "kill_engine" else signal.SIGSTOP)
                if action == "stop_engine":
                    self.stopped.append(pid)
        elif action == "kill_clients":
            with contextlib.suppress(redis.RedisError), self.redis.client() as admin:
                admin.client_kill_filter(_type="normal", skipme=True)
        elif action == "s3_outage":
            self.proxy.cut()
            time.sleep(rng.uniform(2.0, 6.0))
            self.proxy.restore()
        elif action == "restart_redis":
            self.redis.restart()
        self.record(action, at_s, target)

    def record(self, action: str, at_s: float, target: str | None = None) -> None:
        self.log.append(action)
        self.played.append(Played(at_s, action, target))

    def close(self) -> None:
        for pid in self.stopped:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        for worker in [*self.workers, *([self.control] if self.control else [])]:
            worker.stop(timeout_s=20)
        self.proxy.close()
        self.redis.kill()


@contextlib.contextmanager
def fleet(
    root: Path | None = None, extra_env: Callable[[str], dict[str, str]] | None = None
) -> Iterator[Fleet]:
    """Redis, S3 behind a proxy, the control worker and two GPU workers, all ready."""
    import boto3
    from moto.server import ThreadedMotoServer

    os.environ.setdefault("AWS_ACCESS_KEY_ID", "testing")
    os.environ.setdefault("AWS_SECRET_ACCESS_KEY", "testing")
    os.environ.setdefault("AWS_DEFAULT_REGION", "us-east-1")
    base = root or Path(tempfile.mkdtemp(prefix="genfleet-chaos-"))
    (base / "redis").mkdir(parents=True, exist_ok=True)
    server = RedisServer(base / "redis", free_port(), uuid.uuid4().hex)
    server.start()
    port = free_port()
    moto = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    moto.start()
    direct = f"http://127.0.0.1:{port}"
    bucket = f"chaos-{uuid.uuid4().hex[:12]}"
    boto3.client("s3", endpoint_url=direct, region_name="us-east-1").create_bucket(Bucket=bucket)
    proxy = FlakyProxy(("127.0.0.1", port))
    soak = Fleet(base, server, proxy, direct, f"s3://{bucket}/runs", extra_env=extra_env)
    try:
        soak.start_worker("control")
        for _ in range(2):
            soak.start_worker()
        for worker in [soak.control, *soak.workers]:
            assert worker is not None
            worker.wait_ready(120)
        yield soak
    finally:
        soak.close()
        moto.stop()


@dataclass
class SoakResult:
    prompts: int
    seconds: float
    actions: list[str]

    @property
    def prompts_per_s(self) -> float:
        return self.prompts / self.seconds


def run_state(soak: Fleet, run: str) -> str | None:
    """The run's state, or None while Redis cannot be asked (it is being broken on purpose)."""
    from genfleet.producer.status import run_status

    try:
        with soak.redis.client() as client:
            return str(run_status(open_run_store(soak.settings()), client, run)["state"])
    except redis.RedisError:
        return None


def soak_run(
    soak: Fleet,
    run: str,
    prompts: int,
    seed: int | None,
    duration_s: float,
    deadline_s: float,
    mean_gap_s: float = 8.0,
) -> SoakResult:
    """Stage `prompts` prompts as `run`, play the schedule (none when `seed` is None), wait for
    the run to finish by itself, and check the export: every prompt once, nothing parked."""
    source = soak.root / f"{run}.jsonl"
    ids = write_prompts(source, prompts, prefix=f"{run}-")
    settings = soak.settings()
    started = time.monotonic()
    stage(settings, run, source)
    plan = schedule(seed, duration_s, mean_gap_s) if seed is not None else []
    rng = random.Random(seed)
    for at, action in plan:
        while time.monotonic() - started < at:
            if run_state(soak, run) == "done":
                break
            time.sleep(0.2)
        else:
            soak.act(action, rng)
            continue
        break  # the run finished before the schedule did
    while run_state(soak, run) != "done":
        if time.monotonic() - started > deadline_s:
            tails = "\n".join(w.tail(15) for w in soak.workers if w.proc.poll() is None)
            raise AssertionError(f"run {run} not done after {deadline_s:.0f} s:\n{tails}")
        time.sleep(0.5)
    seconds = time.monotonic() - started
    with soak.redis.client() as client:
        assert_exactly_once(settings, run, ids, client)
        from genfleet.common import keys

        parked = client.hgetall(keys.failed_key(run))
        assert not parked, f"batches parked under chaos: {parked}"
    return SoakResult(prompts, seconds, list(soak.log))
