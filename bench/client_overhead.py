"""Completions per second one worker's client path sustains when generation costs nothing.

The emulator runs in zero-time mode (`GENFLEET_EMULATOR_STEP_BASE_MS=0`,
`..._STEP_PER_REQUEST_MS=0`: a request completes on arrival), so what is measured is the hot
path a worker runs per prompt: the `Feeder` (one loop, one limiter, a task per prompt, a
`CompletionRecord` per result, the batch's collector) and the `EngineClient` (request body,
HTTP, the SSE stream read chunk by chunk with the repetition guard on, orjson decode).
Batches of `--batch-size` are run by `--concurrency` threads, each
waiting on its batch's future, as a worker's Celery threads do. Each client gets a fresh
emulator; both share the machine's cores with it, so the figure is a floor.

    python bench/client_overhead.py                    # 60,000 requests
    python bench/client_overhead.py --quick            # 15,000, under a minute

The EngineClient speaks aiohttp, its one HTTP path (httpx managed about a tenth of its rate
at hundreds of connections, see RESULTS.md). In the same run, a bare aiohttp loop (one
session, one semaphore, the same bodies, orjson decode, nothing else) runs the same requests
against its own fresh emulator, streaming too (each chunk decoded): the ratio
`client_vs_bare` (goal >= 0.8) compares on any machine, where the rate moves with it. The
last lines are `requests_per_s: N` and `client_vs_bare: X`.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench._emulator import Emulator  # noqa: E402
from genfleet.common.records import CompletionRecord, GenerationParams, PromptRecord  # noqa: E402
from genfleet.workers.feeding.client import EngineClient  # noqa: E402
from genfleet.workers.feeding.feeder import Feeder  # noqa: E402
from genfleet.workers.process import heap  # noqa: E402

ZERO_TIME = {
    "emulator_step_base_ms": 0,
    "emulator_step_per_request_ms": 0,
    "emulator_load_s": 0,
    "emulator_warmup_s": 0,
    "emulator_mean_completion_tokens": 48,
    "emulator_max_completion_tokens": 256,
}
PARAMS = GenerationParams(max_tokens=256, temperature=0.6, top_p=0.95, thinking=True)


class AlwaysUp:
    """The feeder's engine handle: the emulator is never restarted here."""

    state = "ready"
    deaths = 0
    crashes = 0
    last_error = None

    def alive(self) -> bool:
        return True

    def wait_up(self, timeout_s: float) -> None:
        return None

    def forgive(self, restarts: int) -> None:
        return None


def prompts(count: int) -> list[PromptRecord]:
    return [
        PromptRecord(f"p{i:08d}", [{"role": "user", "content": f"Question {i}: what is {i}+{i}?"}])
        for i in range(count)
    ]


def measure(
    url: str,
    records: list[PromptRecord],
    batch_size: int,
    concurrency: int,
    inflight: int,
) -> tuple[float, int]:
    """Seconds to run every record through a Feeder, and how many came back."""
    feeder = Feeder(
        lambda: EngineClient(
            url,
            model="bench-model",
            timeout_s=600,
            max_connections=inflight + 8,
        ),
        AlwaysUp(),
        inflight,
        identity={"kind": "emulator", "worker": "bench"},
    )
    lock = threading.Lock()
    # counted, not kept: a worker hands each record on to its batch's output and drops it,
    # and 60,000 records held here would make every full collection walk them
    done = [0]
    errors: list[str] = []

    def on_record(index: int, record: CompletionRecord) -> None:
        with lock:
            done[0] += 1
            if record.error:
                errors.append(str(record.error))

    def run(chunk: list[PromptRecord], name: str) -> None:
        feeder.run_batch("bench", name, chunk, PARAMS, on_record).result()

    try:
        run(records[:500], "warmup")  # open the connection pool
        done[0] = 0
        errors.clear()
        batches = [records[i : i + batch_size] for i in range(0, len(records), batch_size)]
        started = time.perf_counter()
        with ThreadPoolExecutor(concurrency) as pool:
            list(pool.map(run, batches, [f"b{i}" for i in range(len(batches))]))
        elapsed = time.perf_counter() - started
    finally:
        feeder.close()
    if errors:
        raise RuntimeError(f"{len(errors)} requests failed: {errors[0]}")
    return elapsed, done[0]


def measure_bare(url: str, records: list[PromptRecord], inflight: int) -> tuple[float, int]:
    """Seconds for a bare aiohttp loop to run every record, and how many came back: the
    floor any client on this machine pays, measured like `measure` (warm-up first)."""
    import aiohttp
    import orjson

    from genfleet.workers.feeding.client import request_body, streamed_body

    bodies = [orjson.dumps(streamed_body(request_body(r, PARAMS, "bench-model"))) for r in records]
    headers = {"Content-Type": "application/json"}

    async def run_all() -> tuple[float, int]:
        connector = aiohttp.TCPConnector(limit=inflight + 8, ttl_dns_cache=None)
        async with aiohttp.ClientSession(connector=connector, headers=headers) as session:
            limiter = asyncio.Semaphore(inflight)
            target = f"{url}/v1/chat/completions"

            async def one(body: bytes) -> int:
                finished = 0
                async with limiter, session.post(target, data=body) as response:
                    # the least a streaming client does: read the stream, decode each chunk
                    for line in (await response.read()).split(b"\n"):
                        if line.startswith(b"data: {"):
                            chunk = orjson.loads(line[6:])
                            for choice in chunk.get("choices") or ():
                                finished |= choice.get("finish_reason") is not None
                    return 1 if response.status == 200 and finished else 0

            await asyncio.gather(*(one(b) for b in bodies[:500]))  # open the pool
            started = time.perf_counter()
            got = sum(await asyncio.gather(*(one(b) for b in bodies)))
            return time.perf_counter() - started, got

    elapsed, got = asyncio.run(run_all())
    if got != len(records):
        raise RuntimeError(f"bare loop: {len(records) - got} requests failed")
    return elapsed, got


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--requests", type=int, default=None)
    parser.add_argument("--max-inflight", type=int, default=256)
    parser.add_argument("--batch-size", type=int, default=256)
    parser.add_argument("--concurrency", type=int, default=3, help="batches at once (threads)")
    parser.add_argument("--rounds", type=int, default=3, help="client/bare rounds for the ratio")
    args = parser.parse_args()
    # As a worker does once it is ready (workers/process/heap.py); both sides run here.
    heap.settle()
    count = args.requests or (15_000 if args.quick else 60_000)
    records = prompts(count)
    engine = Emulator(ZERO_TIME, max_running_requests=4096)
    try:
        engine.wait_ready()
        elapsed, got = measure(
            engine.url, records, args.batch_size, args.concurrency, args.max_inflight
        )
    finally:
        engine.stop()
    rate = got / elapsed
    print(f"aiohttp: {got:,} completions in {elapsed:.2f} s = {rate:,.0f} req/s")
    client_best, bare_best = compare(records, args)
    print(f"requests_per_s: {rate:.0f}")
    print(f"client_vs_bare: {client_best / bare_best:.2f}")


def compare(records: list[PromptRecord], args: argparse.Namespace) -> tuple[float, float]:
    """Best rate of the genfleet client (aiohttp) and of the bare loop over `--rounds`
    alternating rounds, each against a fresh emulator: on a shared machine the best of a few
    is the figure least moved by other processes, and alternating spreads their noise."""
    client_best = bare_best = 0.0
    for _ in range(args.rounds):
        for kind in ("client", "bare"):
            engine = Emulator(ZERO_TIME, max_running_requests=4096)
            try:
                engine.wait_ready()
                if kind == "bare":
                    elapsed, got = measure_bare(engine.url, records, args.max_inflight)
                else:
                    elapsed, got = measure(
                        engine.url,
                        records,
                        args.batch_size,
                        args.concurrency,
                        args.max_inflight,
                    )
            finally:
                engine.stop()
            if kind == "bare":
                bare_best = max(bare_best, got / elapsed)
            else:
                client_best = max(client_best, got / elapsed)
    print(
        f"best of {args.rounds}: client {client_best:,.0f} req/s, bare aiohttp loop "
        f"{bare_best:,.0f} req/s"
    )
    return client_best, bare_best


if __name__ == "__main__":
    main()
