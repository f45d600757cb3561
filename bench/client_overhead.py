"""Completions per second one worker's client path sustains when generation costs nothing.

The emulator runs in zero-time mode (`GENFLEET_EMULATOR_STEP_BASE_MS=0`,
`..._STEP_PER_REQUEST_MS=0`: a request completes on arrival), so what is measured is the hot
path a worker runs per prompt: the `Feeder` (one loop, one limiter, a task per prompt, a
`CompletionRecord` per result, the batch's collector) and the `EngineClient` (request body,
HTTP, orjson decode). Batches of `--batch-size` are run by `--concurrency` threads, each
waiting on its batch's future, as a worker's Celery threads do. Each client gets a fresh
emulator; both share the machine's cores with it, so the figure is a floor.

    python bench/client_overhead.py                    # 60,000 requests
    python bench/client_overhead.py --quick            # 15,000, under a minute

The EngineClient speaks aiohttp, its one HTTP path (httpx managed about a tenth of its rate
at hundreds of connections, see RESULTS.md). The last line is `requests_per_s: N`.
"""

from __future__ import annotations

import argparse
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench._emulator import Emulator  # noqa: E402
from genfleet.common.records import CompletionRecord, GenerationParams, PromptRecord  # noqa: E402
from genfleet.workers.client import EngineClient  # noqa: E402
from genfleet.workers.feeder import Feeder  # noqa: E402

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

    def wait_up(self, timeout_s: float) -> None:
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
    done: list[CompletionRecord] = []

    def on_record(index: int, record: CompletionRecord) -> None:
        with lock:
            done.append(record)

    def run(chunk: list[PromptRecord], name: str) -> None:
        feeder.run_batch("bench", name, chunk, PARAMS, on_record).result()

    try:
        run(records[:500], "warmup")  # open the connection pool
        done.clear()
        batches = [records[i : i + batch_size] for i in range(0, len(records), batch_size)]
        started = time.perf_counter()
        with ThreadPoolExecutor(concurrency) as pool:
            list(pool.map(run, batches, [f"b{i}" for i in range(len(batches))]))
        elapsed = time.perf_counter() - started
    finally:
        feeder.close()
    errors = sum(1 for r in done if r.error)
    if errors:
        raise RuntimeError(f"{errors} requests failed: {next(r.error for r in done if r.error)}")
    return elapsed, len(done)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--requests", type=int, default=None)
    parser.add_argument("--max-inflight", type=int, default=256)
    parser.add_argument("--batch-size", type=int, default=256)
    parser.add_argument("--concurrency", type=int, default=3, help="batches at once (threads)")
    args = parser.parse_args()
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
    print(f"requests_per_s: {rate:.0f}")


if __name__ == "__main__":
    main()
