"""Wall time and peak memory of `enqueue_run` on a large generated dataset.

Writes N prompt lines of JSONL (half chat `messages`, half plain `prompt`, realistic lengths)
into a temporary directory (not timed), then stages and enqueues them in a fresh child
process against a real Redis database (db 12 by default; a queue and run of its own, deleted
afterwards, since others may share the database) and a file:// store in the same temporary
directory. The child reports its own wall time and its
peak RSS (`getrusage(RUSAGE_SELF)`), so neither the generator nor this process counts.

    python bench/producer.py                 # 1,000,000 prompts (goal: <= 60 s, <= 300 MB)
    python bench/producer.py --quick         # 100,000 prompts, well under a minute
    python bench/producer.py --profile out.prof   # cProfile the child

A bare pass over the same file in the same kind of child (read lines, parse with orjson,
dump and gzip each 256 lines as one batch, nothing else) gives the floor this machine sets;
`producer_vs_bare` (goal >= 0.5) compares on any machine, where the rate moves with it. The
last lines are `prompts_per_s: N` and `producer_vs_bare: X`.
"""

from __future__ import annotations

import argparse
import json
import random
import resource
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

import orjson

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

WORDS = (
    "what is the sum of two numbers explain why a model should reason step by step before it "
    "answers prove that every prime greater than two is odd write a function which returns"
).split()


def write_prompts(path: Path, count: int, seed: int = 0) -> int:
    """`count` JSONL prompt lines, 20–120 words each; returns the file size in bytes."""
    rng = random.Random(seed)
    texts = [" ".join(rng.choice(WORDS) for _ in range(rng.randrange(20, 120))) for _ in range(997)]
    with path.open("wb") as handle:
        chunk: list[bytes] = []
        for i in range(count):
            text = texts[i % len(texts)]
            if i % 2:
                row: dict[str, object] = {"id": f"p{i:08d}", "prompt": f"{i}: {text}"}
            else:
                row = {"id": f"p{i:08d}", "messages": [{"role": "user", "content": f"{i}: {text}"}]}
            chunk.append(orjson.dumps(row))
            if len(chunk) >= 10_000:
                handle.write(b"\n".join(chunk) + b"\n")
                chunk.clear()
        if chunk:
            handle.write(b"\n".join(chunk) + b"\n")
    return path.stat().st_size


def child(source: str, store: str, redis_url: str, name: str, profile: str | None) -> None:
    """Runs in the child process: one timed `enqueue_run`, then its figures as JSON."""
    from pydantic import SecretStr

    from genfleet.common.settings import Settings
    from genfleet.producer.enqueue import enqueue_run, reader_options

    settings = Settings(redis_url=SecretStr(redis_url), store=store, queue=name)
    options = reader_options(settings)
    started = time.perf_counter()
    if profile:
        import cProfile

        with cProfile.Profile() as prof:
            result = enqueue_run(settings, name, source, options)
        prof.dump_stats(profile)
    else:
        result = enqueue_run(settings, name, source, options)
    wall_s = time.perf_counter() - started
    peak_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(json.dumps({"wall_s": wall_s, "peak_rss_mb": peak_mb, **result.to_json()}))


def bare(source: str) -> None:
    """Runs in the child process: read, parse and gzip the file in batches, timed."""
    import gzip

    started = time.perf_counter()
    lines = 0
    batch: list[bytes] = []
    with open(source, "rb") as handle:
        for raw in handle:
            batch.append(orjson.dumps(orjson.loads(raw)))
            lines += 1
            if len(batch) == 256:
                gzip.compress(b"\n".join(batch) + b"\n", compresslevel=6, mtime=0)
                batch.clear()
    if batch:
        gzip.compress(b"\n".join(batch) + b"\n", compresslevel=6, mtime=0)
    print(json.dumps({"wall_s": time.perf_counter() - started, "prompts": lines}))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--prompts", type=int, default=None)
    parser.add_argument("--quick", action="store_true", help="100K prompts")
    parser.add_argument("--redis-url", default="redis://127.0.0.1:6379/12")
    parser.add_argument("--profile", default=None, help="write a cProfile of the child here")
    parser.add_argument("--bare", default=None, help=argparse.SUPPRESS)
    parser.add_argument(
        "--child", nargs=4, metavar=("SOURCE", "STORE", "REDIS", "NAME"), help=argparse.SUPPRESS
    )
    args = parser.parse_args()
    if args.bare:
        bare(args.bare)
        return
    if args.child:
        source, store, redis_url, name = args.child
        child(source, store, redis_url, name, args.profile)
        return
    from bench._emulator import forget_run

    count = args.prompts or (100_000 if args.quick else 1_000_000)
    name = f"bench-producer-{uuid.uuid4().hex[:8]}"  # the run and the queue
    with tempfile.TemporaryDirectory(prefix="genfleet-bench-producer-") as tmp:
        source = Path(tmp) / "prompts.jsonl"
        size = write_prompts(source, count)
        store = (Path(tmp) / "store").as_uri()
        try:
            out = subprocess.run(
                [sys.executable, __file__, "--child", str(source), store, args.redis_url, name]
                + (["--profile", args.profile] if args.profile else []),
                check=True,
                capture_output=True,
                text=True,
                cwd=ROOT,
            )
        finally:
            forget_run(args.redis_url, name, f"{name}.emulator")  # its emulator queue
        floor = subprocess.run(
            [sys.executable, __file__, "--bare", str(source)],
            check=True,
            capture_output=True,
            text=True,
            cwd=ROOT,
        )
    figures = json.loads(out.stdout.strip().splitlines()[-1])
    bare_figures = json.loads(floor.stdout.strip().splitlines()[-1])
    bare_rate = bare_figures["prompts"] / bare_figures["wall_s"]
    wall_s = figures["wall_s"]
    print(f"prompts: {figures['prompts']:,} ({size / 1e6:.0f} MB of JSONL)")
    print(f"batches: {figures['batches_total']:,} staged and enqueued")
    print(f"wall_s: {wall_s:.1f}")
    print(f"peak_rss_mb: {figures['peak_rss_mb']:.0f}")
    print(f"bare read-parse-gzip: {bare_rate:.0f} prompts/s")
    print(f"prompts_per_s: {figures['prompts'] / wall_s:.0f}")
    print(f"producer_vs_bare: {figures['prompts'] / wall_s / bare_rate:.2f}")


if __name__ == "__main__":
    main()
