"""Fleet efficiency: how much of N engines' ceiling genfleet turns into tokens, tail included.

N emulated engines (the worker's own engine argv: EAGLE MTP, its default cap, lognormal
completion lengths with the emulator's default mean of 1,800 tokens and the 8,192-token cap:
a heavy tail), and the same prompts run twice, each time against N fresh engines:

(a) ideal: one dispatcher keeps every engine at its cap from one shared prompt list (a lane
    per slot pulls the next prompt the moment its last one finishes), like N
    `sglang.bench_serving --max-concurrency CAP` clients drawing from one file;
(b) genfleet: N real `python -m genfleet.workers worker` processes, one per engine, at default
    settings (batches of 256, 3 batches per worker, the default in-flight limit), fed by
    `enqueue_run` through Redis; the run ends at the last output object in the store.

fleet efficiency = output tokens / (window × N × ceiling), where the window runs from the first
request sent (a) or the `enqueue` call (b) to the last completion (a) or output object (b),
and the ceiling is the emulator's steady tokens/s at its cap (its time model, time-scaled).
Lognormal lengths make even (a) fall short of 1 at the end of a run: the ratio of the two is
what genfleet's dispatch costs. The producer's modules are imported before the clock starts
(Celery's import is a second or so on a busy machine, paid once per process).

    python bench/fleet.py --quick                      # 4 engines, 4 batches each, ~1 min
    python bench/fleet.py --batches-per-worker 2,8,32  # the full run

`--hints RHO` measures length hints instead (a `--regenerate` run's old answers): the same
prompts run twice through genfleet, once as plain prompts (hints off) and once as
conversations whose old answer's length correlates with the emulator's true completion length
at RHO in log space (hints on). Side by side: fleet efficiency and `tail_s`, the last output
of the run minus the moment the fleet's running requests first fell below 90 % of its engines'
caps (after having reached it): the minutes a run spends on its stragglers.

    python bench/fleet.py --hints 0.6 --engines 2 --batch-size 32 --batches-per-worker 32 \
        --knob max_running_requests=64 --repeat 3

The emulator's time scale (`--time-scale`, default 20) shortens the runs; on a machine with
few cores the engines' own stepping competes with the clients, so a higher scale measures the
machine, not the dispatch. The last line is `fleet_vs_ideal: X` (the smallest over the sizes).
"""

from __future__ import annotations

import argparse
import asyncio
import gzip
import os
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

import aiohttp
import httpx
import orjson

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench._emulator import Emulator, Sampler, emulator_env, forget_run, free_port  # noqa: E402
from bench.feeding import engine_command, write_prompts  # noqa: E402
from genfleet.common.settings import Settings  # noqa: E402
from genfleet.producer.enqueue import generation_params  # noqa: E402
from genfleet.workers.engine.emulator.args import SpecConfig  # noqa: E402
from genfleet.workers.engine.emulator.sim.model import TimeModel  # noqa: E402
from genfleet.workers.feeding.client import request_body  # noqa: E402

MODEL = "genfleet/emulated"
TIMELINE = False  # --timeline: print each run's requests per engine, second by second


def fleet_env(args: argparse.Namespace, redis_url: str, queue: str, store: str) -> dict[str, str]:
    """The workers' environment: the emulator at `--time-scale`, `--batch-size`, the queue and
    store given, and every `--knob NAME=VALUE` over them."""
    knobs: dict[str, str | float | int] = {
        "redis_url": redis_url,
        "queue": queue,
        "store": store,
        "emulator_time_scale": args.time_scale,
        "emulator_load_s": 0.2,
        "emulator_warmup_s": 0.2,
        "startup_timeout_s": 120,
        "batch_size": args.batch_size,
    }
    knobs.update(dict(knob.split("=", 1) for knob in args.knob))
    return emulator_env(knobs)


def ceiling_tokens_per_s(info: dict[str, object], time_scale: float) -> float:
    """One engine's steady tokens/s at its cap, from the emulator's own time model."""
    spec = None
    if info.get("speculative_algorithm"):
        spec = SpecConfig(
            algorithm=str(info["speculative_algorithm"]),
            num_steps=int(str(info.get("speculative_num_steps") or 3)),
            eagle_topk=int(str(info.get("speculative_eagle_topk") or 1)),
            num_draft_tokens=int(str(info.get("speculative_num_draft_tokens") or 4)),
        )
    defaults = {"step_base_ms": 12.0, "step_per_request_ms": 0.25, "accept_length": 2.6}
    model = TimeModel(time_scale=time_scale, spec=spec, **defaults)
    cap = int(str(info["max_running_requests"]))
    return model.tokens_per_s(cap, cap)


async def _ideal(urls: list[str], caps: list[int], bodies: list[bytes]) -> tuple[float, int]:
    """Every engine at its cap from one shared list: (seconds to the last response, tokens)."""
    queue = iter(bodies)
    tokens = 0
    headers = {"Content-Type": "application/json"}
    timeout = aiohttp.ClientTimeout(total=3600)
    connector = aiohttp.TCPConnector(limit=sum(caps) + 8)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:

        async def lane(url: str) -> None:
            nonlocal tokens
            for body in queue:
                async with session.post(url, data=body, headers=headers) as response:
                    response.raise_for_status()
                    data = orjson.loads(await response.read())
                tokens += int(data["usage"]["completion_tokens"])

        started = time.perf_counter()
        lanes = [
            lane(f"{u}/v1/chat/completions")
            for u, c in zip(urls, caps, strict=True)
            for _ in range(c)
        ]
        await asyncio.gather(*lanes)
        return time.perf_counter() - started, tokens


def run_ideal(argv: list[str], env: dict[str, str], n: int, bodies: list[bytes]) -> dict[str, Any]:
    knobs = {k[len("GENFLEET_") :].lower(): v for k, v in env.items() if k.startswith("GENFLEET_")}
    engines = [Emulator(knobs, 0, argv=argv) for _ in range(n)]
    try:
        for engine in engines:
            engine.wait_ready()
        infos = [httpx.get(e.url + "/server_info", timeout=10).json() for e in engines]
        caps = [int(i["max_running_requests"]) for i in infos]
        samplers = [Sampler(e.url, 0.1).start() for e in engines]
        window_s, tokens = asyncio.run(_ideal([e.url for e in engines], caps, bodies))
        full = at_cap([s.stop() for s in samplers], caps[0])
    finally:
        for engine in engines:
            engine.stop()
    return {"window_s": window_s, "tokens": tokens, "info": infos[0], "at_cap": full}


def at_cap(samples: list[list[tuple[float, float, float, float]]], cap: int) -> float:
    """The fraction of engine samples, from each engine's first running request to the last
    sample of any, that show the engine running `cap` requests."""
    starts = [next((s[0] for s in engine if s[1] > 0), None) for engine in samples]
    begin = min(t for t in starts if t is not None)
    inside = [s for engine in samples for s in engine if s[0] >= begin]
    if TIMELINE:
        buckets: dict[int, list[float]] = {}
        for s in inside:
            buckets.setdefault(int(s[0] - begin), []).append(s[1] + s[2])
        print(" ".join(f"{sum(v) / len(v):.0f}" for _, v in sorted(buckets.items())))
    return sum(1 for s in inside if s[1] >= cap) / max(1, len(inside))


def _start_workers(
    env: dict[str, str], n: int, tmp: Path
) -> list[tuple[subprocess.Popen[bytes], Path, int]]:
    workers = []
    for i in range(n):
        log = tmp / f"worker-{i}.log"
        port = free_port()
        proc = subprocess.Popen(
            [sys.executable, "-m", "genfleet.workers", "worker", "--hostname", f"fleet{i}@bench"],
            env={**env, "GENFLEET_PORT": str(port)},
            cwd=ROOT,
            stdout=log.open("wb"),
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        workers.append((proc, log, port))
    deadline = time.monotonic() + 180
    for proc, log, _ in workers:
        while " ready." not in log.read_text(errors="replace"):
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"worker did not start:\n{log.read_text()[-3000:]}")
            time.sleep(0.1)
    return workers


def _stop_workers(workers: list[tuple[subprocess.Popen[bytes], Path, int]]) -> None:
    for proc, _, _ in workers:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)
    for proc, _, _ in workers:
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def run_genfleet(
    env: dict[str, str],
    n: int,
    source: Path,
    tmp: Path,
    timeout_s: float,
    **run_settings: Any,
) -> dict[str, Any]:
    """N real workers, one enqueue; from the enqueue call to the last output object."""
    from pydantic import SecretStr

    from genfleet.producer import broker  # noqa: F401 - imported before the clock starts
    from genfleet.producer.enqueue import enqueue_run, reader_options

    run = env["GENFLEET_QUEUE"]
    store = Path(env["GENFLEET_STORE"].removeprefix("file://"))
    outputs = store / run / "outputs"
    workers = _start_workers(env, n, tmp)
    try:
        settings = Settings(
            redis_url=SecretStr(env["GENFLEET_REDIS_URL"]),
            store=env["GENFLEET_STORE"],
            queue=run,
            batch_size=int(env["GENFLEET_BATCH_SIZE"]),
            **(
                {"batch_tail": int(env["GENFLEET_BATCH_TAIL"])}
                if "GENFLEET_BATCH_TAIL" in env
                else {}
            ),
            **run_settings,
        )
        samplers = [Sampler(f"http://127.0.0.1:{port}", 0.1).start() for _, _, port in workers]
        started = time.time()
        result = enqueue_run(settings, run, str(source), reader_options(settings))
        deadline = time.monotonic() + timeout_s
        while len(list(outputs.glob("*.jsonl.gz"))) < result.batches_total:
            if any(p.poll() is not None for p, _, _ in workers) or time.monotonic() > deadline:
                raise RuntimeError(f"run did not finish:\n{workers[0][1].read_text()[-3000:]}")
            time.sleep(0.02)
        # the engines' cap as the workers passed it (their /server_info wants the engine's
        # random API key, which only the worker holds)
        argv = engine_command(env)
        cap = int(argv[argv.index("--max-running-requests") + 1])
        samples = [s.stop() for s in samplers]
        full = at_cap(samples, cap)
        import redis

        client = redis.Redis.from_url(env["GENFLEET_REDIS_URL"])
        first = float(client.hget(f"genfleet:run:{run}:counters", "started_at") or started)
        client.close()
    finally:
        _stop_workers(workers)
        forget_run(env["GENFLEET_REDIS_URL"], run, f"{run}.emulator")  # its emulator queue
    files = list(outputs.glob("*.jsonl.gz"))
    end = max(f.stat().st_mtime for f in files)
    tokens = 0
    per_worker: dict[str, int] = {}
    idle_from: dict[str, float] = {}  # when each worker wrote its last output
    for f in files:
        for line in gzip.decompress(f.read_bytes()).splitlines():
            row = orjson.loads(line)
            used = int((row.get("usage") or {}).get("completion_tokens") or 0)
            tokens += used
            worker = str((row.get("engine") or {}).get("worker"))
            per_worker[worker] = per_worker.get(worker, 0) + used
            idle_from[worker] = max(idle_from.get(worker, 0.0), f.stat().st_mtime - started)
    return {
        "window_s": end - started,
        "tokens": tokens,
        "batches": result.batches_total,
        "per_worker": per_worker,
        "idle_from": sorted(idle_from.values()),
        "first_batch_s": first - started,
        "at_cap": full,
        "tail_s": None if (fell := fell_below(samples, n * cap)) is None else end - fell,
    }


def fell_below(samples: list[list[tuple[float, float, float, float]]], caps: int) -> float | None:
    """When the fleet's running requests (all engines, each at its last sample) first fell
    below 90 % of `caps` after having reached it; None when they never reached it."""
    events = sorted((s[0], engine, s[1]) for engine, rows in enumerate(samples) for s in rows)
    running = [0.0] * len(samples)
    reached = False
    for when, engine, value in events:
        running[engine] = value
        full = sum(running) >= 0.9 * caps
        if full:
            reached = True
        elif reached:
            return when
    return None


def hinted_prompts(
    path: Path, records: list[Any], rho: float, mean_tokens: int, seed: int = 7
) -> float:
    """`records` as ShareGPT conversations whose old answer is as long as a hint correlated at
    `rho` (log space) with the emulator's own completion length of the prompt; returns the
    correlation the hints reached."""
    import math
    import random

    from genfleet.workers.engine.emulator.sim.model import COMPLETION_SIGMA, natural_length
    from genfleet.workers.engine.emulator.sim.text import chat_prompt, prompt_seed

    rng = random.Random(seed)
    mu = math.log(mean_tokens) - COMPLETION_SIGMA**2 / 2
    pairs = []
    with path.open("wb") as handle:
        for record in records:
            key, _ = chat_prompt(record.messages, thinking=True)
            true_z = (
                math.log(natural_length(prompt_seed(key), mean_tokens)) - mu
            ) / COMPLETION_SIGMA
            hint_z = rho * true_z + math.sqrt(1 - rho**2) * rng.gauss(0.0, 1.0)
            hint = max(1, round(math.exp(mu + COMPLETION_SIGMA * hint_z)))
            pairs.append((true_z, hint_z))
            turns = [{"from": "human", "value": record.messages[0]["content"]},
                     {"from": "gpt", "value": "w" * (4 * hint)}]  # fmt: skip
            handle.write(orjson.dumps({"id": record.id, "conversations": turns}) + b"\n")
    xs, ys = zip(*pairs, strict=True)
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    cov = sum((x - mx) * (y - my) for x, y in pairs)
    return cov / math.sqrt(sum((x - mx) ** 2 for x in xs) * sum((y - my) ** 2 for y in ys))


def hints_size(args: argparse.Namespace, per_worker: int, redis_url: str) -> float:
    """Hints off vs on, side by side (`--repeat` pairs, alternating); returns the median
    tail_s(on) / median tail_s(off)."""
    import statistics

    n = args.engines
    count = n * per_worker * args.batch_size
    results: dict[str, list[dict[str, Any]]] = {"off": [], "on": []}
    with tempfile.TemporaryDirectory(prefix="genfleet-bench-hints-") as name:
        tmp = Path(name)
        plain = tmp / "prompts.jsonl"
        records = write_prompts(plain, count)
        mean = int(
            dict(k.split("=", 1) for k in args.knob).get("emulator_mean_completion_tokens", 1800)
        )
        hinted = tmp / "regenerate.jsonl"
        rho = hinted_prompts(hinted, records, args.hints, mean)
        modes = (("off", plain, {}), ("on", hinted, {"regenerate": True}))
        for attempt, (mode, source, extra) in enumerate(modes * args.repeat):
            queue = f"bench-hints-{mode}-{uuid.uuid4().hex[:8]}"
            env = fleet_env(args, redis_url, queue, (tmp / f"store-{attempt}").as_uri())
            (tmp / str(attempt)).mkdir()
            results[mode].append(run_genfleet(env, n, source, tmp / str(attempt), 3600, **extra))
        argv = engine_command(env)  # the engines' cap, as the workers passed it
        cap = int(argv[argv.index("--max-running-requests") + 1])
    spec_info = {"max_running_requests": cap, "speculative_algorithm": "EAGLE"}
    ceiling = n * ceiling_tokens_per_s(spec_info, args.time_scale)
    print(
        f"{n} engines (cap {cap}) × {per_worker} batches of {args.batch_size} ({count} prompts), "
        f"hints at rho {rho:.2f}, ceiling {ceiling:,.0f} tok/s:"
    )
    medians: dict[str, tuple[float, float]] = {}
    for mode in ("off", "on"):
        for r in results[mode]:
            tail = "n/a" if r["tail_s"] is None else f"{r['tail_s']:.2f} s"
            print(
                f"  hints {mode:>3}: {r['tokens']:,} tokens in {r['window_s']:.2f} s, efficiency "
                f"{r['tokens'] / (r['window_s'] * ceiling):.3f}, tail_s {tail}, {r['batches']} "
                f"batches; workers' last outputs at "
                f"{', '.join(f'{t:.1f}' for t in r['idle_from'])} s"
            )
        tails = [r["tail_s"] for r in results[mode] if r["tail_s"] is not None]
        effs = [r["tokens"] / (r["window_s"] * ceiling) for r in results[mode]]
        medians[mode] = (
            statistics.median(tails) if tails else float("nan"),
            statistics.median(effs) if effs else float("nan"),
        )
    tokens = {r["tokens"] for mode in results.values() for r in mode}
    if len(tokens) > 1:
        print("  warning: token totals differ: the engines were asked different things")
    for mode in ("off", "on"):
        tail, eff = medians[mode]
        print(
            f"  median of {args.repeat}, hints {mode:>3}: tail_s {tail:.2f} s, efficiency {eff:.3f}"
        )
    ratio = medians["on"][0] / medians["off"][0]
    print(f"  tail_on_vs_off at {per_worker} batches per worker: {ratio:.3f}")
    return ratio


def one_size(args: argparse.Namespace, per_worker: int, redis_url: str) -> float:
    n = args.engines
    count = n * per_worker * args.batch_size
    with tempfile.TemporaryDirectory(prefix="genfleet-bench-fleet-") as name:
        tmp = Path(name)
        # a queue of its own: others may share the database
        env = fleet_env(
            args, redis_url, f"bench-fleet-{uuid.uuid4().hex[:8]}", (tmp / "store").as_uri()
        )
        argv = engine_command(env)
        source = tmp / "prompts.jsonl"
        records = write_prompts(source, count)
        params = generation_params(Settings())  # the defaults a run gets
        bodies = [orjson.dumps(request_body(r, params, MODEL)) for r in records]
        ideal = run_ideal(argv, env, n, bodies)
        ours = run_genfleet(env, n, source, tmp, timeout_s=3600)
    ceiling = n * ceiling_tokens_per_s(ideal["info"], args.time_scale)
    eff_ideal = ideal["tokens"] / (ideal["window_s"] * ceiling)
    eff_ours = ours["tokens"] / (ours["window_s"] * ceiling)
    shares = sorted(ours["per_worker"].values())
    print(
        f"{n} engines × {per_worker} batches of {args.batch_size} ({count} prompts), "
        f"ceiling {ceiling:,.0f} tok/s:\n"
        f"     ideal: {ideal['tokens']:,} tokens in {ideal['window_s']:.2f} s, "
        f"efficiency {eff_ideal:.3f}; engines at cap {ideal['at_cap']:.1%} of samples\n"
        f"  genfleet: {ours['tokens']:,} tokens in {ours['window_s']:.2f} s, "
        f"efficiency {eff_ours:.3f}; tokens per worker {shares}; workers' last outputs "
        f"at {', '.join(f'{t:.1f}' for t in ours['idle_from'])} s; first batch started at "
        f"{ours['first_batch_s']:.2f} s; engines at cap {ours['at_cap']:.1%} of samples"
    )
    if ideal["tokens"] != ours["tokens"]:
        print(f"  warning: token totals differ ({ideal['tokens']} vs {ours['tokens']})")
    ratio = float(eff_ours / eff_ideal)
    print(f"  fleet_vs_ideal at {per_worker} batches per worker: {ratio:.3f}")
    return ratio


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="4 batches per worker")
    parser.add_argument("--engines", type=int, default=4)
    parser.add_argument("--batches-per-worker", default=None, help="comma-separated sizes")
    parser.add_argument("--batch-size", type=int, default=256, help="the default setting")
    parser.add_argument("--time-scale", type=float, default=20.0)
    parser.add_argument("--redis-url", default="redis://127.0.0.1:6379/13")
    parser.add_argument(
        "--knob", action="append", default=[], help="SETTING=VALUE for the run (repeatable)"
    )
    parser.add_argument("--timeline", action="store_true", help="requests per engine per second")
    parser.add_argument(
        "--hints", type=float, default=None, help="length hints at this correlation vs none"
    )
    parser.add_argument("--repeat", type=int, default=1, help="--hints: pairs of runs")
    args = parser.parse_args()
    global TIMELINE
    TIMELINE = args.timeline
    sizes = [
        int(s) for s in (args.batches_per_worker or ("4" if args.quick else "2,8,32")).split(",")
    ]
    if args.hints is not None:
        tails = [hints_size(args, size, args.redis_url) for size in sizes]
        print(f"tail_on_vs_off: {max(tails):.3f}")
        return
    ratios = [one_size(args, size, args.redis_url) for size in sizes]
    print(f"fleet_vs_ideal: {min(ratios):.3f}")


if __name__ == "__main__":
    main()
