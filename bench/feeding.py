"""How close genfleet keeps an engine to a saturating client, and how far batch-sync falls.

One emulator configuration (the worker's own engine argv: EAGLE MTP, `--max-running-requests
64`, lognormal completion lengths, time-scaled), the same prompts, three clients run one after
the other in this one process, each against a fresh emulator started with identical knobs:

(a) direct: keeps exactly the engine's cap (64) in flight, streaming, like `sglang.bench_serving
    --max-concurrency 64`: aiohttp + asyncio straight at the emulator;
(b) genfleet: `enqueue_run` → Redis → a real `python -m genfleet.workers worker` process (its engine
    started by its own supervisor from the same knobs) → one output object per batch;
(c) batch-sync: send a batch of `--batch-size` prompts, wait for all of it, send the next.

Every run is timed the same way, from the engine's side: it starts at the first /metrics
sample (every 20 ms) showing a running request, and ends at the last response (a, c) or the
last output object written to the store (b). Output tokens are `usage.completion_tokens`
summed over every completion. Steady state is the middle 80 % of each run by time, measured
with the engine's `generation_tokens_total` counter; "at cap" is the fraction of samples with
64 requests running.

    python bench/feeding.py            # 4,000 prompts, mean 1,800 tokens, time scale 100
    python bench/feeding.py --quick    # 3,000 prompts, mean 600 tokens, under a minute

The last line is `genfleet_vs_direct: R`, the whole-run b/a ratio.
"""

from __future__ import annotations

import argparse
import asyncio
import gzip
import os
import shlex
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

import aiohttp
import orjson

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench._emulator import Emulator, Sampler, emulator_env, forget_run, free_port  # noqa: E402
from genfleet.common.records import GenerationParams, PromptRecord  # noqa: E402
from genfleet.workers.feeding.client import request_body, streamed_body  # noqa: E402

CAP = 64
MODEL = "genfleet/emulated"
Sample = tuple[float, float, float, float]


@dataclass
class Outcome:
    """One client's run: the engine's samples, the run's ends and the tokens it produced."""

    name: str
    samples: list[Sample]
    start_s: float
    end_s: float
    tokens: int
    completions: int

    @property
    def duration_s(self) -> float:
        return self.end_s - self.start_s

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.duration_s

    def window(self, lo: float, hi: float) -> list[Sample]:
        return [s for s in self.samples if lo <= s[0] <= hi]

    def steady_tokens_per_s(self, trim: float = 0.1) -> float:
        """Generation tokens/s over the middle of the run, from the engine's counter."""
        lo = self.start_s + trim * self.duration_s
        hi = self.end_s - trim * self.duration_s
        inside = self.window(lo, hi)
        if len(inside) < 2:
            return float("nan")
        first, last = inside[0], inside[-1]
        return (last[3] - first[3]) / (last[0] - first[0])

    def at_cap(self, trim: float = 0.0) -> float:
        """The fraction of the samples inside the run that show the engine at its cap."""
        lo = self.start_s + trim * self.duration_s
        hi = self.end_s - trim * self.duration_s
        inside = self.window(lo, hi)
        return sum(1 for s in inside if s[1] >= CAP) / max(1, len(inside))


def first_running(samples: list[Sample]) -> float:
    """The time of the first sample with a running request: where every run starts."""
    return next(s[0] for s in samples if s[1] > 0)


def write_prompts(path: Path, count: int) -> list[PromptRecord]:
    records = []
    with path.open("wb") as handle:
        for i in range(count):
            text = f"Problem {i}: find the sum of the first {i % 97 + 3} odd numbers and explain."
            record = PromptRecord(f"q{i:06d}", [{"role": "user", "content": text}])
            handle.write(orjson.dumps(record.to_json()) + b"\n")
            records.append(record)
    return records


def engine_command(env: dict[str, str]) -> list[str]:
    """The worker's engine argv, without --port, exactly as its supervisor would build it."""
    out = subprocess.run(
        [sys.executable, "-m", "genfleet.workers", "worker", "--print-engine-command"],
        env=env,
        cwd=ROOT,
        check=True,
        capture_output=True,
        text=True,
    ).stdout.strip()
    command = [line for line in out.splitlines() if line and not line.startswith("#")][-1]
    words = shlex.split(command)
    argv = [w for w in words if "=" not in w or w.startswith("-")]
    return argv[: argv.index("--port")] + argv[argv.index("--port") + 2 :]


async def _post_all(
    url: str, bodies: list[bytes], concurrency: int, batch: int | None
) -> tuple[float, int, int]:
    """(a) or (c): the time of the last response, and tokens and completions received.
    Streamed answers (SSE), read chunk by chunk as genfleet's client reads them.

    aiohttp, as `sglang.bench_serving` uses: with 64+ connections httpx's pool is itself the
    bottleneck (a few hundred requests/s), and a reference client must not be one.
    """
    tokens = completions = 0
    last = 0.0
    connector = aiohttp.TCPConnector(limit=concurrency)
    headers = {"Content-Type": "application/json"}
    timeout = aiohttp.ClientTimeout(total=3600)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:

        async def one(body: bytes) -> None:
            nonlocal tokens, completions, last
            async with session.post(
                url + "/v1/chat/completions", data=body, headers=headers
            ) as response:
                response.raise_for_status()
                usage = None
                # the least a streaming client does: read the stream, decode each chunk
                for line in (await response.read()).split(b"\n"):
                    if line.startswith(b"data: {"):
                        usage = orjson.loads(line[6:]).get("usage") or usage
            assert usage is not None, "a stream without usage"
            tokens += int(usage["completion_tokens"])
            completions += 1
            last = time.time()

        if batch is None:  # keep exactly `concurrency` requests open until the prompts run out
            queue = iter(bodies)

            async def lane() -> None:
                for body in queue:
                    await one(body)

            await asyncio.gather(*(lane() for _ in range(concurrency)))
        else:  # one batch at a time, all of it at once
            for i in range(0, len(bodies), batch):
                await asyncio.gather(*(one(body) for body in bodies[i : i + batch]))
    return last, tokens, completions


def run_client(
    name: str, argv: list[str], env: dict[str, str], bodies: list[bytes], batch: int | None
) -> Outcome:
    engine = _emulator_with_env(argv, env)
    try:
        engine.wait_ready()
        sampler = Sampler(engine.url, 0.02).start()
        concurrency = CAP if batch is None else batch
        last, tokens, completions = asyncio.run(_post_all(engine.url, bodies, concurrency, batch))
        samples = sampler.stop()
    finally:
        engine.stop()
    return Outcome(name, samples, first_running(samples), last, tokens, completions)


def _emulator_with_env(argv: list[str], env: dict[str, str]) -> Emulator:
    """A fresh emulator with the worker's argv and GENFLEET_ knobs."""
    knobs = {k[len("GENFLEET_") :].lower(): v for k, v in env.items() if k.startswith("GENFLEET_")}
    return Emulator(knobs, CAP, argv=argv)


def run_genfleet(
    env: dict[str, str], source: Path, tmp: Path, batch_size: int, timeout_s: float
) -> Outcome:
    """(b): a real worker process and a real enqueue; ends at the last output object."""
    from pydantic import SecretStr

    from genfleet.common.settings import Settings
    from genfleet.producer.enqueue import enqueue_run, reader_options

    port = free_port()
    env = {**env, "GENFLEET_PORT": str(port)}
    log = tmp / "worker.log"
    worker = subprocess.Popen(
        [sys.executable, "-m", "genfleet.workers", "worker", "--hostname", "bench@feeding"],
        env=env,
        cwd=ROOT,
        stdout=log.open("wb"),
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    store = Path(env["GENFLEET_STORE"].removeprefix("file://"))
    run = env["GENFLEET_QUEUE"]  # unique to this invocation: the run and its queue
    outputs = store / run / "outputs"
    try:
        deadline = time.monotonic() + 120
        while " ready." not in log.read_text(errors="replace"):
            if worker.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"worker did not start:\n{log.read_text()[-3000:]}")
            time.sleep(0.1)
        sampler = Sampler(f"http://127.0.0.1:{port}", 0.02).start()
        settings = Settings(
            redis_url=SecretStr(env["GENFLEET_REDIS_URL"]),
            store=env["GENFLEET_STORE"],
            queue=run,
            batch_size=batch_size,
            max_tokens=int(env["GENFLEET_MAX_TOKENS"]),
        )
        result = enqueue_run(settings, run, str(source), reader_options(settings))
        deadline = time.monotonic() + timeout_s
        while len(list(outputs.glob("*.jsonl.gz"))) < result.batches_total:
            if worker.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"run did not finish:\n{log.read_text()[-3000:]}")
            time.sleep(0.02)
        samples = sampler.stop()
    finally:
        if worker.poll() is None:
            os.killpg(worker.pid, signal.SIGTERM)
            try:
                worker.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(worker.pid, signal.SIGKILL)
        forget_run(env["GENFLEET_REDIS_URL"], run, f"{run}.emulator")  # its emulator queue
    files = list(outputs.glob("*.jsonl.gz"))
    end = max(f.stat().st_mtime for f in files)
    tokens = completions = 0
    for f in files:
        for line in gzip.decompress(f.read_bytes()).splitlines():
            row = orjson.loads(line)
            tokens += int((row.get("usage") or {}).get("completion_tokens") or 0)
            completions += 0 if row.get("error") else 1
    return Outcome("genfleet", samples, first_running(samples), end, tokens, completions)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--prompts", type=int, default=None)
    parser.add_argument("--time-scale", type=float, default=100.0)
    parser.add_argument("--mean-tokens", type=int, default=None)
    parser.add_argument("--batch-size", type=int, default=256)
    parser.add_argument("--max-inflight", type=int, default=None, help="default: the worker's")
    parser.add_argument("--worker-concurrency", type=int, default=3)
    parser.add_argument(
        "--stream-chunk-tokens", type=int, default=None, help="default: the worker's"
    )
    parser.add_argument("--redis-url", default="redis://127.0.0.1:6379/13")
    args = parser.parse_args()
    count = args.prompts or (3000 if args.quick else 4000)
    mean = args.mean_tokens or (600 if args.quick else 1800)
    max_tokens = int(mean * 8192 / 1800)  # the same tail shape: the 8K cap over a 1.8K mean
    params = GenerationParams(max_tokens=max_tokens, temperature=0.6, top_p=0.95, thinking=True)

    with tempfile.TemporaryDirectory(prefix="genfleet-bench-feeding-") as name:
        tmp = Path(name)
        knobs: dict[str, str | float | int] = {
            "redis_url": args.redis_url,
            "queue": f"bench-feeding-{uuid.uuid4().hex[:8]}",  # others may share the database
            "store": (tmp / "store").as_uri(),
            "emulator_time_scale": args.time_scale,
            "emulator_mean_completion_tokens": mean,
            "emulator_max_completion_tokens": max_tokens,
            "emulator_load_s": 0.2,
            "emulator_warmup_s": 0.2,
            "max_running_requests": CAP,
            "max_tokens": max_tokens,
            "batch_size": args.batch_size,
            "worker_concurrency": args.worker_concurrency,
            "startup_timeout_s": 60,
        }
        if args.max_inflight:
            knobs["max_inflight"] = args.max_inflight
        if args.stream_chunk_tokens:
            knobs["stream_chunk_tokens"] = args.stream_chunk_tokens
        env = emulator_env(knobs)
        argv = engine_command(env)
        source = tmp / "prompts.jsonl"
        records = write_prompts(source, count)
        # streamed, as genfleet's client asks (the usage arrives in the stream's last chunk)
        bodies = [orjson.dumps(streamed_body(request_body(r, params, MODEL))) for r in records]
        print(
            f"{count} prompts, mean {mean} / max {max_tokens} tokens, cap {CAP}, "
            f"time scale {args.time_scale:g}, batches of {args.batch_size}, "
            f"worker concurrency {args.worker_concurrency}"
        )
        outcomes = [run_client("direct", argv, env, bodies, None)]
        outcomes.append(run_genfleet(env, source, tmp, args.batch_size, timeout_s=600))
        outcomes.append(run_client("batch-sync", argv, env, bodies, args.batch_size))

    direct = outcomes[0]
    for o in outcomes:
        print(
            f"{o.name:>10}: {o.completions} completions, {o.tokens:,} tokens in "
            f"{o.duration_s:.2f} s = {o.tokens_per_s:,.0f} tok/s; steady "
            f"{o.steady_tokens_per_s():,.0f} tok/s; at cap {o.at_cap():.1%} of the run, "
            f"{o.at_cap(0.1):.1%} of its middle 80 %"
        )
    genfleet, batch_sync = outcomes[1], outcomes[2]
    if {o.tokens for o in outcomes} != {direct.tokens}:
        print(f"warning: token totals differ: {[o.tokens for o in outcomes]}")
    steady = genfleet.steady_tokens_per_s() / direct.steady_tokens_per_s()
    print(f"steady_genfleet_vs_direct: {steady:.3f}")
    print(f"batch_sync_vs_direct: {batch_sync.tokens_per_s / direct.tokens_per_s:.3f}")
    print(f"genfleet_vs_direct: {genfleet.tokens_per_s / direct.tokens_per_s:.3f}")


if __name__ == "__main__":
    main()
