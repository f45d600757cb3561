"""Peak memory of `export_run` on a large fake run, and whether it grows with the run.

Writes two fake finished runs (a small one and one four times larger, realistic record sizes)
into a file store under a temporary directory, exports each in a fresh child process, and
prints each child's own peak RSS (`getrusage(RUSAGE_SELF)` in the child, so neither the
generator nor the other export is counted) and records per second. A streaming export has
a large/small peak RSS ratio near 1.0; one that held the run in memory would approach 4.

    python bench/export_memory.py             # 50K and 200K records
    python bench/export_memory.py --quick     # 5K and 20K, well under a minute
    python bench/export_memory.py --format parquet

The last line is `export_peak_rss_mb: N` for the larger run.
"""

from __future__ import annotations

import argparse
import gzip
import json
import random
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import orjson

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from genfleet.common import keys  # noqa: E402
from genfleet.common.manifest import BatchEntry, write_manifest  # noqa: E402
from genfleet.common.records import GenerationParams
from genfleet.common.settings import Settings  # noqa: E402
from genfleet.common.store import FileStore  # noqa: E402

BATCH_SIZE = 256
WORDS = "the of a model answer token reason step because therefore we check value sum".split()


def make_run(root: Path, run: str, records: int, seed: int = 0) -> None:
    """A finished run: manifest plus one output object per batch, one batch in memory at a time."""
    rng = random.Random(seed)
    text = " ".join(rng.choice(WORDS) for _ in range(200_000))
    store = FileStore(root)
    entries = []
    for index, start in enumerate(range(0, records, BATCH_SIZE)):
        batch = keys.batch_id(index)
        count = min(BATCH_SIZE, records - start)
        lines = []
        for i in range(start, start + count):
            at = rng.randrange(0, len(text) - 4000)
            reasoning_chars = rng.randrange(200, 2400)
            lines.append(
                orjson.dumps(
                    {
                        "id": f"r{i:08d}",
                        "run": run,
                        "batch": batch,
                        "messages": [{"role": "user", "content": text[at : at + 300]}],
                        "reasoning": text[at + 300 : at + 300 + reasoning_chars],
                        "content": text[at + 2700 : at + 2700 + rng.randrange(0, 900)],
                        "finish_reason": "stop",
                        "usage": {
                            "prompt_tokens": 60,
                            "completion_tokens": reasoning_chars // 4 + 100,
                            "reasoning_tokens": reasoning_chars // 4,
                        },
                        "model": "bench",
                        "engine": {"kind": "emulator", "worker": "w0"},
                        "latency_s": 1.0,
                        "error": None,
                        "sample": 0,
                        "custom_id": None,
                        "request_id": f"req-{i}",
                    }
                )
            )
        data = gzip.compress(b"\n".join(lines) + b"\n", compresslevel=1)
        store.put_if_absent(keys.output_key(run, batch), data)
        entries.append(BatchEntry(batch=batch, key=keys.input_key(run, batch), prompts=count))
    write_manifest(
        store,
        run,
        "be4c4",
        entries,
        source="bench",
        format="jsonl",
        fingerprint="bench",
        created_at=time.time(),
        params=GenerationParams(max_tokens=8192, temperature=0.6, top_p=0.95, thinking=True),
        prompts_total=records,
        rejects=0,
    )


def export_child(store: Path, run: str, out: Path, fmt: str) -> dict[str, float]:
    """Run one export in a fresh interpreter; its peak RSS and throughput."""
    completed = subprocess.run(
        [sys.executable, __file__, "--child", str(store), run, str(out), fmt],
        check=True,
        capture_output=True,
        text=True,
    )
    stats: dict[str, float] = json.loads(completed.stdout.strip().splitlines()[-1])
    return stats


def child(store: str, run: str, out: str, fmt: str) -> None:
    from genfleet.producer.export import export_run

    settings = Settings(store=Path(store).as_uri())
    start = time.perf_counter()
    result = export_run(settings, run, out, fmt)
    elapsed = time.perf_counter() - start
    peak_kb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux
    print(
        json.dumps({"records": result.records, "seconds": elapsed, "peak_rss_mb": peak_kb / 1024})
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="5K and 20K records")
    parser.add_argument("--records", type=int, default=None, help="records of the larger run")
    parser.add_argument("--format", default="jsonl", choices=["jsonl", "parquet", "openai"])
    parser.add_argument("--child", nargs=4, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(*args.child)
        return
    large = args.records or (20_000 if args.quick else 200_000)
    sizes = [large // 4, large]
    peaks = []
    with tempfile.TemporaryDirectory(prefix="genfleet-bench-") as tmp:
        root = Path(tmp)
        for n in sizes:
            run = f"bench-{n}"
            start = time.perf_counter()
            make_run(root / "store", run, n)
            made_s = time.perf_counter() - start
            out = root / f"{run}.{args.format}"
            stats = export_child(root / "store", run, out, args.format)
            size_mb = out.stat().st_size / 1e6
            peaks.append(stats["peak_rss_mb"])
            print(
                f"records={n:,} generate_s={made_s:.1f} export_s={stats['seconds']:.1f} "
                f"records_per_s={stats['records'] / stats['seconds']:,.0f} "
                f"out_mb={size_mb:.0f} peak_rss_mb={stats['peak_rss_mb']:.0f}"
            )
            out.unlink()
    print(f"peak_rss_ratio_large_over_small: {peaks[1] / peaks[0]:.2f} (records ratio 4.0)")
    print(f"export_peak_rss_mb: {peaks[1]:.0f}")


if __name__ == "__main__":
    main()
