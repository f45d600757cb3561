"""What the tests on real SGLang share (`tests/workers/test_real_sglang*_gpu.py`): the engine
settings the carried SGLang needs, a worker stack (Redis, one GPU worker whose supervisor
starts the engine, the control worker) and the comparisons of a run's answers."""

from __future__ import annotations

import contextlib
import importlib.util
import os
import secrets
import shutil
import signal
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import redis

from genfleet.common.settings import Settings
from genfleet.producer.status import read_findings, run_status
from harness.assertions import assert_exactly_once
from harness.env import ROOT, base_env, free_port
from harness.processes import Worker, live_children
from harness.runs import fault_settings, open_run_store, stage
from harness.services import RedisServer
from harness.sources import write_prompts
from harness.waits import wait_for

MODELS = Path(os.environ.get("GENFLEET_GPU_MODELS", "/tmp/m"))
ENGINE_EXTRA = os.environ.get("GENFLEET_GPU_ENGINE_EXTRA", "")
# What the carried SGLang needs (bench/real_sglang/README.md): no FA3 kernels, no flashinfer JIT.
ENGINE_ENV = {
    "GENFLEET_ATTENTION_BACKEND": "triton",
    "GENFLEET_MEM_FRACTION_STATIC": "0.6",
    # GENFLEET_GPU_ENGINE_EXTRA adds flags of a measurement (--enable-deterministic-inference).
    "GENFLEET_ENGINE_EXTRA_ARGS": " ".join(
        ["--sampling-backend pytorch --grammar-backend none", *ENGINE_EXTRA.split()]
    ),
    "GENFLEET_STARTUP_TIMEOUT_S": "400",
    "GENFLEET_GPUS": "0",
}


def missing(models: tuple[Path, ...]) -> str | None:
    """Why the tests on real SGLang cannot run here (None: they can): no GPU, no SGLang, no
    Redis server, or one of `models` not built."""
    if shutil.which("nvidia-smi") is None:
        return "no NVIDIA GPU (nvidia-smi)"
    if importlib.util.find_spec("sglang") is None:
        return "no sglang importable (bench/real_sglang/device.sh setup)"
    if shutil.which("redis-server") is None:
        return "no redis-server on PATH"
    for model in models:
        if not (model / "config.json").is_file():
            return f"no checkpoint {model} (bench/real_sglang/build_model.py or build_27b.py)"
    return None


@dataclass
class Stack:
    """Redis, one GPU worker (its engine started by its supervisor) and the control worker."""

    env: dict[str, str]
    settings: Settings
    client: redis.Redis
    worker: Worker
    control: Worker
    engine_url: str
    api_key: str  # the worker's engine key, given here so a test can call the engine too

    @property
    def auth(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"}

    def engine_pid(self) -> int:
        wait_for(
            lambda: len(live_children(self.worker.proc.pid, b"sglang")) == 1,
            60,
            "one engine process",
        )
        return live_children(self.worker.proc.pid, b"sglang")[0]

    def findings(self, cause: str) -> list[dict[str, Any]]:
        found = read_findings(self.client)
        return [f for f in found if cause in (f.get("cause"), f.get("verdict"))]

    def run(
        self,
        run: str,
        count: int,
        tmp_path: Path,
        max_tokens: int | None = None,
        prefix: str | None = None,
        **updates: Any,
    ) -> list[str]:
        ids = write_prompts(tmp_path / f"{run}.jsonl", count, prefix=prefix or f"{run}-")
        settings = self.settings.model_copy(update=updates)
        if max_tokens is not None:
            settings = settings.model_copy(update={"max_tokens": max_tokens})
        stage(settings, run, tmp_path / f"{run}.jsonl")
        return ids

    def running(self) -> float:
        """Requests running inside the engine now (`sglang:num_running_reqs`)."""
        text = httpx.get(f"{self.engine_url}/metrics", timeout=10).text
        lines = [line for line in text.splitlines() if line.startswith("sglang:num_running_reqs{")]
        return sum(float(line.rsplit(" ", 1)[1]) for line in lines)

    def in_flight(self, run: str, ids: list[str]) -> float:
        """Wait until the run has requests running in the engine and prompts not done; the
        number running. Long answers (random weights run to max_tokens) keep them there."""
        wait_for(lambda: self.running() >= 4, 180, "requests running in the engine", 0.2)
        running = self.running()
        assert self.progress(run)["prompts_done"] < len(ids), "the run ended before the fault"
        return running

    def progress(self, run: str) -> dict[str, Any]:
        return run_status(open_run_store(self.settings), self.client, run)


@contextlib.contextmanager
def worker_stack(tmp: Path, model: Path, hostname: str, port: int, **extra: str) -> Iterator[Stack]:
    server = RedisServer(tmp, free_port(), "gpu-tests")
    server.start()
    store = f"file://{tmp / 'store'}"
    env = base_env(server.url, store, log_dir=tmp / "logs")
    api_key = secrets.token_hex(16)
    env["GENFLEET_ENGINE_API_KEY"] = api_key
    env["PYTHONPATH"] = os.environ.get("PYTHONPATH", str(ROOT))
    env.update(ENGINE_ENV)
    env |= {
        "GENFLEET_MODEL": str(model),
        "GENFLEET_ENGINE": "sglang",
        "GENFLEET_PORT": str(port),
        "GENFLEET_MAX_TOKENS": "96",
        "GENFLEET_BATCH_SIZE": "50",
        "GENFLEET_POWER_WATCH_INTERVAL_S": "5",
        "GENFLEET_POWER_WINDOW_S": "10",
        "GENFLEET_SHUTDOWN_GRACE_S": "5",
        # Random weights (`--load-format dummy`, tiny models): their answers are junk by design,
        # and the gate would pause every run after 50 of them.
        "GENFLEET_QUALITY_GATE": "false",
        **extra,
    }
    settings = fault_settings(server.url, store, batch_size=50, max_tokens=96, model=str(model))
    worker = Worker(env, tmp / "worker.log", hostname, ["worker"])
    control = Worker(env, tmp / "control.log", f"control-{hostname}", ["control"])
    client = server.client()
    try:
        worker.wait_ready(420)
        control.wait_ready(60)
        yield Stack(env, settings, client, worker, control, f"http://127.0.0.1:{port}", api_key)
    finally:
        worker.stop(60)
        control.stop(30)
        client.close()
        server.kill()


def answers(stack: Stack, run: str, ids: list[str]) -> dict[str, dict[str, Any]]:
    """The run's rows by prompt id (each prompt exactly once, none an error)."""
    _, rows = assert_exactly_once(stack.settings, run, ids, stack.client)
    assert all(row["error"] is None for row in rows)
    return {row["id"]: row for row in rows}


def text(row: dict[str, Any]) -> str:
    return (row.get("reasoning") or "") + "\x00" + (row.get("content") or "")


def agreement(rows: dict[str, dict[str, Any]], twin: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """How far `rows` agree with `twin`, prompt by prompt: identical answers, and where the
    others first differ (characters in, of their length)."""
    same, firsts = 0, []
    for name, row in rows.items():
        a, b = text(row), text(twin[name])
        if a == b:
            same += 1
            continue
        first = next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), None)
        firsts.append(min(len(a), len(b)) if first is None else first)
    return {"answers": len(rows), "identical": same, "first_difference_chars": sorted(firsts)}


def done(stack: Stack, run: str) -> bool:
    return bool(stack.progress(run)["state"] == "done")


def wait_drawn(stack: Stack, run: str, ids: list[str]) -> None:
    """Until answers are well into their drawing: requests running, tokens streamed."""
    assert stack.in_flight(run, ids) > 0
    time.sleep(4.0)


def lose_worker(
    stack: Stack,
    run: str,
    ids: list[str],
    log: Path,
    hostname: str,
    start_s: float,
    drawing_s: float = 8.0,
) -> dict[str, dict[str, Any]]:
    """SIGKILL the stack's worker and its engine mid-answer, `drawing_s` after requests run
    (by default after a checkpoint of the answers in flight: every 3 s), start a new worker
    (its own engine, within `start_s`), and return the run's rows once it is done. The
    stack's worker is gone after it."""
    assert stack.in_flight(run, ids) > 0
    time.sleep(drawing_s)
    engine = stack.engine_pid()
    stack.worker.kill(signal.SIGKILL)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(os.getpgid(engine), signal.SIGKILL)
    stack.worker.proc.wait()
    fresh = Worker(stack.env, log, hostname, ["worker"])
    try:
        fresh.wait_ready(start_s)
        wait_for(lambda: done(stack, run), start_s + 300, f"run {run}", 1.0)
        return answers(stack, run, ids)
    finally:
        fresh.stop(60)
