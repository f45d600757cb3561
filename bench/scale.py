"""Per-call cost of genfleet's commands as a run grows: 1K, 10K and 100K batches.

For each size it synthesises one run directly, with no engine and no worker: a manifest of N
batches and output objects for 90 % of them in a file:// store (a temporary directory), and
in Redis what a fleet would have left there: the run's counters and throughput points, 1 %
of its batches failed, the rest as work orders in the broker's queue, up to 1,000 of them
delivered (kombu's `unacked` hash, the running hash, a live lease each), and the progress
keys workers write as outputs are confirmed (`common/progress.py`). Then each command runs in
a fresh child process, which reports its own wall time (the best of three for a command that
changes nothing, of 100 for `status` and `runs`) and its peak RSS above what it held before
the command ran (its modules imported; `ru_maxrss` would be the parent's, kept across exec):

    status, status --verify, runs, enqueue --resume, retry, cancel, delete, export --partial,
    the reaper pass (leases) and its lost-orders pass, and the power-watch pass over 1,000
    simulated workers' pushed summaries.

The last table gives, per command, the growth exponent k between the two largest sizes
(time ∝ batches^k): k ≈ 0 is a per-call cost that does not grow with the run, k ≈ 1 one that
grows with it (export reads every output: it must); and the same for peak RSS above the
imports (k RSS). `--manifest whole` writes the run's manifest as one object, as runs staged
before the manifest was sharded have it (still read, whole): the same commands side by side
with the sharded form. The Redis database given is flushed.

    python bench/scale.py --redis-url redis://127.0.0.1:6379/8                 # 1K, 10K
    python bench/scale.py --redis-url redis://127.0.0.1:6379/8 --sizes 1000,10000,100000
    python bench/scale.py ... --only status,cancel        # some commands only
    python bench/scale.py ... --manifest whole            # a run staged before shards
"""

from __future__ import annotations

import argparse
import base64
import gzip
import json
import math
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

import orjson

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

RUN = "scale"
PROMPTS_PER_BATCH = 256
WORKERS = 1000
COMMANDS = (
    "status",
    "status_verify",
    "runs",
    "resume",
    "retry",
    "cancel",
    "export_partial",
    "reaper",
    "lost_orders",
    "power_watch",
    "delete",  # last: it removes the run
)
MUTATES = {"resume", "retry", "cancel", "reaper", "lost_orders", "delete"}
# Commands of a millisecond: the best of 100, or one scheduler hiccup decides their k.
REPEAT = {"status": 100, "runs": 100}


def settings_for(redis_url: str, store: str) -> Any:
    from pydantic import SecretStr

    from genfleet.common.settings import Settings

    return Settings(redis_url=SecretStr(redis_url), store=store, engine="emulator")


def _output(batch: str) -> bytes:
    rows = [
        {
            "id": f"{batch}-{i}",
            "run": RUN,
            "batch": batch,
            "messages": [{"role": "user", "content": "q"}],
            "reasoning": None,
            "content": "a",
            "finish_reason": "stop",
            "usage": {"prompt_tokens": 1, "completion_tokens": 1, "reasoning_tokens": 0},
        }
        for i in range(2)
    ]
    return gzip.compress(b"".join(orjson.dumps(r) + b"\n" for r in rows), mtime=0)


def layout(n: int) -> dict[str, list[str]]:
    """Which batches are done, failed, delivered (running) and waiting in the queue."""
    from genfleet.common import keys

    ids = [keys.batch_id(i) for i in range(n)]
    done_n = n * 9 // 10
    failed_n = max(n // 100, 1)
    rest = ids[done_n + failed_n :]
    running_n = min(WORKERS, len(rest) // 2)
    return {
        "done": ids[:done_n],
        "failed": ids[done_n : done_n + failed_n],
        "running": rest[:running_n],
        "queued": rest[running_n:],
        "all": ids,
    }


def build_store(root: Path, redis_url: str, n: int, manifest: str = "sharded") -> None:
    """The run's objects: its manifest (`sharded`, or `whole`: one object holding every
    entry, as runs staged before shards have it) and the outputs of its done batches."""
    from genfleet.common import keys
    from genfleet.common.manifest import BatchEntry
    from genfleet.common.routing import model_ref
    from genfleet.producer.enqueue import generation_params
    from genfleet.producer.runs.identity import staging_params

    settings = settings_for(redis_url, root.as_uri())
    ref = model_ref(settings)
    plan = layout(n)
    entries = [
        BatchEntry(batch=b, key=keys.input_key(RUN, b), prompts=PROMPTS_PER_BATCH)
        for b in plan["all"]
    ]
    fields: dict[str, Any] = {
        "source": "synthetic",
        "format": "jsonl",
        "fingerprint": "0" * 64,
        "created_at": time.time(),
        "params": generation_params(settings),
        "model": ref.model,
        "engine": ref.engine,
        "staging": staging_params(settings),
        "prompts_total": n * PROMPTS_PER_BATCH,
        "rejects": 0,
    }
    (root / RUN / "outputs").mkdir(parents=True, exist_ok=True)
    if manifest == "whole":
        whole = {**fields, "params": fields["params"].model_dump(), "run": RUN, "version": 2}
        whole["batches"] = [entry.model_dump() for entry in entries]
        (root / keys.manifest_key(RUN)).write_bytes(orjson.dumps(whole))
    else:
        from genfleet.common.manifest import write_manifest
        from genfleet.common.store import FileStore

        write_manifest(FileStore(root), RUN, STAGING_ID, entries, **fields)
    data = _output("x")
    for batch in plan["done"]:
        (root / keys.output_key(RUN, batch)).write_bytes(data)


STAGING_ID = "5ca1e"


def _message(order: dict[str, Any], queue: str) -> bytes:
    from genfleet.common.celery_config import GENERATE_TASK

    body = base64.b64encode(orjson.dumps([[], {"order": order}, {}])).decode()
    return orjson.dumps(
        {
            "body": body,
            "content-encoding": "utf-8",
            "content-type": "application/json",
            "headers": {"task": GENERATE_TASK, "id": f"{order['run']}.{order['batch']}"},
            "properties": {
                "body_encoding": "base64",
                "delivery_tag": uuid.uuid4().hex,
                "delivery_info": {"exchange": "", "routing_key": queue},
                "priority": 0,
            },
        }
    )


def build_redis(redis_url: str, store_url: str, n: int, leases: bool = True) -> None:
    """What a fleet leaves in Redis for a run of `n` batches (the database is flushed)."""
    import redis

    from genfleet.common import keys
    from genfleet.common.routing import model_ref, work_queue
    from genfleet.producer.enqueue import generation_params

    settings = settings_for(redis_url, store_url)
    ref = model_ref(settings)
    queue = work_queue(settings.queue, ref)
    params = generation_params(settings).model_dump()
    client = redis.Redis.from_url(redis_url)
    client.flushdb()
    plan = layout(n)
    now = time.time()

    def order(batch: str) -> dict[str, Any]:
        return {
            "run": RUN,
            "batch": batch,
            "key": keys.input_key(RUN, batch),
            "params": params,
            "model": ref.model,
            "engine": ref.engine,
            "prompts": PROMPTS_PER_BATCH,
            "enqueued_at": now,
        }

    pipe = client.pipeline(transaction=False)
    pipe.sadd(keys.runs_key(), RUN)
    pipe.sadd(keys.work_queues_key(), queue)
    pipe.hset(
        keys.counters_key(RUN),
        mapping={
            "started_at": now - 3600,
            "prompts_generated": len(plan["done"]) * PROMPTS_PER_BATCH,
            "tokens_generated": len(plan["done"]) * PROMPTS_PER_BATCH * 500,
            "completion_tokens": len(plan["done"]) * PROMPTS_PER_BATCH * 500,
            "last_done_at": now,
        },
    )
    _throughput(pipe, now)
    for batch in plan["failed"]:
        pipe.hset(keys.failed_key(RUN), batch, "EngineDown: synthetic")
    for i, batch in enumerate(plan["queued"]):
        pipe.lpush(queue, _message(order(batch), queue))
        pipe.sadd(keys.queued_key(RUN), batch)
        if i % 5000 == 4999:
            pipe.execute()
    for i, batch in enumerate(plan["running"]):
        tag = uuid.uuid4().hex
        message = orjson.loads(_message(order(batch), queue))
        pipe.hset(keys.UNACKED, tag, orjson.dumps([message, "", queue]))
        pipe.zadd(keys.UNACKED_INDEX, {tag: now})
        entry = {**order(batch), "claimed_at": now - 600, "worker": f"w{i}@node"}
        pipe.hset(keys.running_key(), f"{RUN}/{batch}", orjson.dumps(entry))
        pipe.sadd(keys.queued_key(RUN), batch)
        if leases and i % 100:  # one in a hundred leases expired: the reaper has work
            pipe.set(keys.lease_key(RUN, batch), f"w{i}@node", ex=600)
        elif leases:  # and seen lapsed by the reaper's last pass: this one reaps it
            pipe.hset(keys.lapsed_key(), f"{RUN}/{batch}", now - settings.lease_ttl_s)
    pipe.execute()
    _build_progress(client, settings, plan)
    _build_workers(client, settings, now)


def _throughput(pipe: Any, now: float) -> None:
    """The last ten minutes of 1,000 workers' progress: 1,000 tokens every 2 s each."""
    from genfleet.common.throughput import add

    for i in range(300 * WORKERS):
        add(pipe, RUN, f"w{i % WORKERS}@node", 1000, now - (i // WORKERS) * 2)
        if i % 5000 == 4999:
            pipe.execute()


def _build_progress(client: Any, settings: Any, plan: dict[str, list[str]]) -> None:
    """The progress keys workers write when an output is confirmed (absent before them)."""
    try:
        from genfleet.common import progress
    except ImportError:
        return
    from genfleet.common.manifest import Manifest
    from genfleet.common.store import store_of

    store = store_of(settings)
    manifest = Manifest.load(store, RUN)
    assert manifest is not None
    progress.reconcile(client, store, manifest, set(plan["done"]), now=time.time())


def _build_workers(client: Any, settings: Any, now: float) -> None:
    """1,000 workers' pushed GPU summaries, when workers push them."""
    try:
        from genfleet.workers.observe import pushed
    except ImportError:
        return
    pipe = client.pipeline(transaction=False)
    for i in range(WORKERS):
        worker = f"w{i}@node{i // 8}"
        summary = {
            "ts": now,
            "worker": worker,
            "node": f"node{i // 8}",
            "window_s": 60.0,
            "gpus": [
                {
                    "uuid": f"GPU-{i:04d}",
                    "index": i % 8,
                    "power_w": 650.0,
                    "power_limit_w": 700.0,
                    "mean_power_w": 650.0,
                    "samples": 60,
                    "energy_j": 39000.0,
                }
            ],
            "engine": {"running": 64, "queued": 8, "max_running_requests": 64},
            "inflight": 72,
            "max_inflight": 72,
            "queues": [settings.queue + ".emulator"],
        }
        pushed.push(pipe, worker, summary)
    pipe.execute()


# --- the child: one command, timed ---------------------------------------------------------


def child(command: str, redis_url: str, store_url: str, out_dir: str) -> dict[str, Any]:
    import redis

    from genfleet.common.store import store_of

    settings = settings_for(redis_url, store_url)
    store = store_of(settings)
    client = redis.Redis.from_url(redis_url)
    fn = _command(command, settings, store, client, out_dir)
    import genfleet.common.progress
    import genfleet.producer.broker  # noqa: F401 - imported on first use: not the command's

    rss0 = _peak_reset()
    elapsed = math.inf
    # The shared machine's load only ever adds: the best of three of a command that changes
    # nothing (once for one that does).
    for _ in range(
        1 if command in MUTATES or command == "export_partial" else REPEAT.get(command, 3)
    ):
        started = time.perf_counter()
        fn()
        elapsed = min(elapsed, time.perf_counter() - started)
    return {"command": command, "time_s": elapsed, "rss_mb": _peak_mb() - rss0}


def _status_mb(field: str) -> float | None:
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith(f"{field}:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return None


def _peak_reset() -> float:
    """The RSS now, with the peak reset to it. `ru_maxrss` cannot serve: Linux keeps it
    across fork and exec, so a child starts with its parent's peak (the synthesised run)."""
    rss = _status_mb("VmRSS")
    if rss is None:  # not Linux: the peak so far
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    Path("/proc/self/clear_refs").write_text("5")  # VmHWM := VmRSS
    return rss


def _peak_mb() -> float:
    peak = _status_mb("VmHWM")
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024 if peak is None else peak


def _command(command: str, settings: Any, store: Any, client: Any, out_dir: str) -> Any:
    from genfleet.producer.status import run_status

    if command == "status":
        return lambda: run_status(store, client, RUN)
    if command == "status_verify":
        import inspect

        if "verify" not in inspect.signature(run_status).parameters:
            return lambda: run_status(store, client, RUN)  # the one path there is
        return lambda: run_status(store, client, RUN, verify=True)
    if command == "runs":
        from genfleet.producer.runs.lifecycle import list_runs

        return lambda: list_runs(store, client)
    if command in {"resume", "retry"}:
        return _resume(command, settings)
    if command == "cancel":
        from genfleet.producer.runs.lifecycle import cancel_run

        return lambda: cancel_run(store, client, RUN)
    if command == "delete":
        from genfleet.producer.runs.lifecycle import delete_run

        return lambda: delete_run(settings, store, client, RUN, wait_s=5.0)
    if command == "export_partial":
        from genfleet.producer.export import export_run

        return lambda: export_run(settings, RUN, f"{out_dir}/export.jsonl", partial=True)
    if command == "reaper":
        return _reaper(settings, store, client)
    if command == "lost_orders":
        return _lost_orders(settings, store, client)
    if command == "power_watch":
        return _power_watch(settings, client)
    raise SystemExit(f"unknown command {command}")


def _resume(command: str, settings: Any) -> Any:
    from genfleet.producer import commands
    from genfleet.producer.enqueue import enqueue_run, reader_options

    if command == "retry":
        return lambda: commands.retry(
            RUN,
            redis_url=settings.redis_url.get_secret_value(),
            store=settings.store,
            s3_endpoint_url=None,
        )
    return lambda: enqueue_run(settings, RUN, None, reader_options(settings), verify=True)


def _reaper(settings: Any, store: Any, client: Any) -> Any:
    from genfleet.workers.control.reaper import reap

    sent: list[dict[str, Any]] = []
    return lambda: reap(client, store, settings.lease_ttl_s, time.time(), sent.append)


def _lost_orders(settings: Any, store: Any, client: Any) -> Any:
    """The reaper round's other half: queued batches no order holds, sent again."""
    from genfleet.workers.control.lost_orders import reconcile_orders

    sent: list[Any] = []
    return lambda: reconcile_orders(client, store, settings.lease_ttl_s, sent.append)


def _power_watch(settings: Any, client: Any) -> Any:
    try:
        from genfleet.workers.observe.power_watch import watch_pass
    except ImportError:
        # Before pushed summaries: the pass around the broadcast (which cannot be simulated:
        # 1,000 replies inside one inspect timeout), its Redis reads and the diagnosis.
        from genfleet.workers.observe.diagnosis import diagnose
        from genfleet.workers.observe.power_watch import fleet_state

        def around_broadcast() -> None:
            now = time.time()
            diagnose({}, fleet_state(client, settings, now), now, 0.7, 1.2)

        return around_broadcast
    return lambda: watch_pass(client, settings, time.time())


# --- the parent ----------------------------------------------------------------------------


def run_child(command: str, redis_url: str, store_url: str, out_dir: str) -> dict[str, Any]:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    argv = [sys.executable, __file__, "--child", command, "--redis-url", redis_url]
    proc = subprocess.run(
        [*argv, "--store", store_url, "--out", out_dir],
        env=env,
        capture_output=True,
        text=True,
        check=False,
    )
    if proc.returncode != 0:
        raise SystemExit(f"{command} failed:\n{proc.stderr[-3000:]}")
    result: dict[str, Any] = json.loads(proc.stdout.strip().splitlines()[-1])
    return result


def measure(
    n: int, redis_url: str, only: list[str], manifest: str = "sharded"
) -> dict[str, dict[str, Any]]:
    results: dict[str, dict[str, Any]] = {}
    base = Path(tempfile.mkdtemp(prefix="genfleet-scale-"))
    try:
        root = base / "store"
        root.mkdir()
        started = time.perf_counter()
        build_store(root, redis_url, n, manifest)
        build_redis(redis_url, root.as_uri(), n)
        built_s = time.perf_counter() - started
        print(f"# {n:,} batches synthesised in {built_s:.1f} s", file=sys.stderr, flush=True)
        for command in only:
            if command in MUTATES:
                build_redis(redis_url, root.as_uri(), n, leases=command != "delete")
            results[command] = run_child(command, redis_url, root.as_uri(), str(base))
            r = results[command]
            print(
                f"#   {command:15s} {r['time_s']:8.3f} s  {r['rss_mb']:8.1f} MB",
                file=sys.stderr,
                flush=True,
            )
    finally:
        shutil.rmtree(base, ignore_errors=True)
    return results


def growth(t_small: float, t_big: float, n_small: int, n_big: int, floor: float = 1e-4) -> float:
    """k of time ∝ batches^k between two sizes (floored at 0.1 ms: noise below that)."""
    a, b = max(t_small, floor), max(t_big, floor)
    return math.log(b / a) / math.log(n_big / n_small)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--redis-url", required=True, help="a database this bench may flush")
    parser.add_argument("--sizes", default="1000,10000")
    parser.add_argument("--only", default=",".join(COMMANDS))
    parser.add_argument(
        "--manifest",
        choices=("sharded", "whole"),
        default="sharded",
        help="the run's manifest as staging writes it, or one object (runs staged before shards)",
    )
    parser.add_argument("--json", action="store_true", help="one JSON document on stdout")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--store", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(child(args.child, args.redis_url, args.store, args.out)))
        return
    sizes = [int(s) for s in args.sizes.split(",")]
    only = [c for c in COMMANDS if c in args.only.split(",")]
    table = {n: measure(n, args.redis_url, only, args.manifest) for n in sizes}
    small, big = sizes[-2], sizes[-1]
    rows = []
    for command in only:
        times = [table[n][command]["time_s"] for n in sizes]
        rss = [table[n][command]["rss_mb"] for n in sizes]
        k = growth(times[-2], times[-1], small, big) if len(sizes) > 1 else None
        # RSS below 1 MB is the allocator's noise: floored there.
        k_rss = growth(rss[-2], rss[-1], small, big, floor=1.0) if len(sizes) > 1 else None
        rows.append(
            {
                "command": command,
                **{f"time_s_{n}": round(t, 4) for n, t in zip(sizes, times, strict=True)},
                **{f"rss_mb_{n}": round(m, 1) for n, m in zip(sizes, rss, strict=True)},
                "k": None if k is None else round(k, 2),
                "k_rss": None if k_rss is None else round(k_rss, 2),
            }
        )
    if args.json:
        print(json.dumps({"sizes": sizes, "manifest": args.manifest, "rows": rows}))
        return
    head = ["command", *[f"{n:,} batches" for n in sizes], "k", *[f"RSS @{n:,}" for n in sizes]]
    print(" | ".join([*head, "k RSS"]))
    for row in rows:
        cells = [row["command"], *[f"{row[f'time_s_{n}']:.4f} s" for n in sizes], f"{row['k']}"]
        cells += [f"{row[f'rss_mb_{n}']:.1f} MB" for n in sizes]
        print(" | ".join([*cells, f"{row['k_rss']}"]))


if __name__ == "__main__":
    main()
