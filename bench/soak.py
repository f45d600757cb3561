"""The long soak: days of wear compressed into one run, against a clean run on the same fleet.

The fleet is `tests/faults/chaos.py`'s (a private redis-server with AOF, moto S3 behind a proxy
that can be cut, the control worker and two GPU workers with emulator engines). A clean run of
`--clean-prompts` gives the fleet's pace; then `--prompts` prompts run while a seeded schedule
breaks things for `--duration-s`: worker SIGKILLs (a new worker takes the place), engine
SIGKILLs (crashes) and SIGSTOPs (freezes), Redis client kills, broker blips (Redis away a few
seconds, back on the same port), one Redis restart in the middle third, S3 outages, and a
producer SIGKILLed while it stages a run, then run again. Every engine keeps a request log, so
each fault's cost is counted as the prompts sent again after it, before the next one.

It prints `goodput_vs_clean` (prompts per second of wall time, chaos over clean), prompts
lost and doubled in the exports (both must be 0), the workers still consuming at the end (must
be all), and the prompts redone per fault kind.

    python bench/soak.py                       # 20,000 prompts, 20 minutes of faults
    python bench/soak.py --duration-s 60 --prompts 1500 --clean-prompts 500   # a short one

Poison prompts (a prompt that crashes the engine) are not in the schedule yet: the emulator's
`--emulator-crash-on-prompt TEXT` (through `--engine-extra-args`) could make one.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import logging
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import orjson

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from tests.faults.chaos import ACTIONS, Fleet, fleet, run_state  # noqa: E402
from tests.support import control_app, stage  # noqa: E402
from tests.support import write_prompts as write_plain  # noqa: E402

SOAK_ACTIONS = (*ACTIONS, "broker_blip", "kill_producer")
BLIP_S = 4.0


def write_prompts(path: Path, count: int, prefix: str) -> list[str]:
    """`count` prompts whose texts name their run, so that the request logs tell every prompt
    of every run apart (the plain ones repeat from run to run)."""
    texts = {i: f"{prefix} question {i}: what is {i} + {i}?" for i in range(count)}
    return write_plain(path, count, texts, prefix=prefix)


class Sends:
    """Every chat request the fleet's engines accepted, read from their request logs as they
    grow: how many times each prompt was sent."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.offsets: dict[Path, int] = {}
        self.counts: collections.Counter[str] = collections.Counter()

    def resent(self) -> int:
        """Prompts sent again so far (each send after a prompt's first)."""
        for path in sorted(self.root.glob("requests-*.jsonl")):
            with path.open("rb") as handle:
                handle.seek(self.offsets.get(path, 0))
                data = handle.read()
            complete = data[: data.rfind(b"\n") + 1]
            self.offsets[path] = self.offsets.get(path, 0) + len(complete)
            for line in complete.splitlines():
                entry = orjson.loads(line)
                if entry["outcome"] in {"ok", "abort"}:
                    self.counts[entry["body"]["messages"][-1]["content"]] += 1
        return sum(n - 1 for n in self.counts.values())


def log_engines(soak: Fleet) -> None:
    """Give every worker started from now on its own engine request log."""
    plain = soak.env

    def env() -> dict[str, str]:
        values = plain()
        values["GENFLEET_EMULATOR_REQUEST_LOG"] = str(
            soak.root / f"requests-{os.urandom(4).hex()}.jsonl"
        )
        return values

    soak.env = env  # type: ignore[method-assign]


def schedule(seed: int, duration_s: float, mean_gap_s: float) -> list[tuple[float, str]]:
    """(seconds from the start, action): every kind once in each round of len(SOAK_ACTIONS)
    faults, shuffled, at exponential gaps; one Redis restart in the middle third."""
    rng = random.Random(seed)
    plan: list[tuple[float, str]] = []
    kinds: list[str] = []
    at = rng.uniform(2.0, mean_gap_s)
    while at < duration_s:
        if not kinds:
            kinds = list(SOAK_ACTIONS)
            rng.shuffle(kinds)
        plan.append((round(at, 1), kinds.pop()))
        at += rng.expovariate(1.0 / mean_gap_s)
    plan.append((round(rng.uniform(duration_s / 3, 2 * duration_s / 3), 1), "restart_redis"))
    return sorted(plan)


def act(soak: Fleet, action: str, rng: random.Random, producer_runs: list[str]) -> None:
    if action == "broker_blip":
        soak.redis.shutdown()
        time.sleep(BLIP_S)  # the blip itself
        soak.redis.start()
        soak.log.append(action)
    elif action == "kill_producer":
        producer_runs.append(kill_producer(soak, f"staged{len(producer_runs)}", rng))
        soak.log.append(action)
    else:
        soak.act(action, rng)


def kill_producer(soak: Fleet, run: str, rng: random.Random) -> str:
    """`genfleet enqueue` of a new run, SIGKILLed while it stages, then run again to the end."""
    source = soak.root / f"{run}.jsonl"
    write_prompts(source, 200, prefix=f"{run}-")
    env = {**soak.env(), "GENFLEET_S3_ENDPOINT_URL": soak.s3_direct, "GENFLEET_BATCH_SIZE": "25"}
    argv = ["genfleet", "enqueue", str(source), "--run", run]
    proc = subprocess.Popen(argv, env=env, cwd=ROOT, stdout=subprocess.DEVNULL)
    time.sleep(rng.uniform(0.5, 2.0))  # somewhere in its staging
    with contextlib.suppress(ProcessLookupError):
        os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    subprocess.run(argv, env=env, cwd=ROOT, stdout=subprocess.DEVNULL, check=True, timeout=300)
    return run


def wait_done(soak: Fleet, runs: list[str], deadline_s: float, started: float) -> None:
    while any(run_state(soak, run) != "done" for run in runs):
        if time.monotonic() - started > deadline_s:
            raise SystemExit(f"runs not done after {deadline_s:.0f} s: {runs}")
        time.sleep(1.0)


def exported(soak: Fleet, run: str, ids: list[str]) -> tuple[int, int]:
    """(lost, doubled) prompts of `run`'s export, against its input ids."""
    from genfleet.producer.export import export_run

    target = soak.root / f"{run}-export.jsonl"
    result = export_run(soak.settings(), run, str(target), "jsonl", partial=True)
    counts = collections.Counter(
        orjson.loads(line)["id"] for line in target.read_bytes().splitlines()
    )
    lost = len(set(ids) - set(counts))
    return lost, sum(n - 1 for n in counts.values()) + result.duplicates


def consuming(soak: Fleet) -> tuple[int, int]:
    """(live workers, live workers consuming their queue) at the end."""
    import redis

    live = [w.hostname for w in soak.workers if w.proc.poll() is None]
    replies: dict[str, Any] = {}
    for _ in range(5):  # a connection the soak's last fault left broken is tried again
        try:
            with control_app(soak.redis.url) as app:
                inspect = app.control.inspect(destination=live, timeout=2.0)
                replies = inspect.active_queues() or {}
            break
        except (OSError, redis.RedisError):
            time.sleep(1.0)
    return len(live), sum(1 for name in live if replies.get(name))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=int, default=20_000)
    parser.add_argument("--clean-prompts", type=int, default=5_000)
    parser.add_argument("--duration-s", type=float, default=1200.0)
    parser.add_argument("--mean-gap-s", type=float, default=15.0)
    parser.add_argument("--seed", type=int, default=7)
    args = parser.parse_args()
    logging.getLogger("werkzeug").setLevel(logging.WARNING)
    rng = random.Random(args.seed)
    with fleet(Path(tempfile.mkdtemp(prefix="genfleet-soak-"))) as soak:
        log_engines(soak)
        for worker in list(soak.workers):  # the fleet's first workers get their logs too
            worker.stop(timeout_s=30)
            soak.workers.remove(worker)
            soak.start_worker().wait_ready(120)
        clean_ids = write_prompts(soak.root / "clean.jsonl", args.clean_prompts, prefix="c-")
        started = time.monotonic()
        stage(soak.settings(), "clean", soak.root / "clean.jsonl")
        wait_done(soak, ["clean"], 3600.0, started)
        clean_s = time.monotonic() - started
        print(f"clean: {args.clean_prompts} prompts in {clean_s:.1f} s", flush=True)

        sends = Sends(soak.root)
        baseline = sends.resent()
        ids = write_prompts(soak.root / "soak.jsonl", args.prompts, prefix="s-")
        started = time.monotonic()
        stage(soak.settings(), "soak", soak.root / "soak.jsonl")
        cost: dict[str, int] = collections.defaultdict(int)
        producer_runs: list[str] = []
        last_action, last_resent = "before any fault", baseline
        for at, action in schedule(args.seed, args.duration_s, args.mean_gap_s):
            while time.monotonic() - started < at and run_state(soak, "soak") != "done":
                time.sleep(0.5)
            now_resent = sends.resent()
            cost[last_action] += now_resent - last_resent
            act(soak, action, rng, producer_runs)
            last_action, last_resent = action, sends.resent()
        wait_done(soak, ["soak", *producer_runs], 3600.0 + args.duration_s, started)
        soak_s = time.monotonic() - started
        cost[last_action] += sends.resent() - last_resent
        lost, doubled = exported(soak, "soak", ids)
        for run in producer_runs:
            run_lost, run_doubled = exported(soak, run, [f"{run}-{i:05d}" for i in range(200)])
            lost, doubled = lost + run_lost, doubled + run_doubled
        clean_lost, clean_doubled = exported(soak, "clean", clean_ids)
        live, consuming_now = consuming(soak)
        counted = collections.Counter(soak.log)
    report: dict[str, Any] = {
        "clean_prompts_per_s": round(args.clean_prompts / clean_s, 2),
        "soak_prompts_per_s": round(args.prompts / soak_s, 2),
        "soak_s": round(soak_s, 1),
        "faults": dict(counted),
        "prompts_redone_after": dict(cost),
        "lost": lost + clean_lost,
        "doubled": doubled + clean_doubled,
        "workers_live": live,
        "workers_consuming": consuming_now,
    }
    print(orjson.dumps(report, option=orjson.OPT_INDENT_2).decode())
    print(f"goodput_vs_clean: {report['soak_prompts_per_s'] / report['clean_prompts_per_s']:.3f}")
    if report["lost"] or report["doubled"] or consuming_now != live:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
