"""Goodput under chaos, as a ratio to a fault-free run of the same data on the same fleet.

The fleet and the fault schedule are `harness/chaos.py`'s: a private redis-server (AOF
on), moto S3 behind a proxy that can be cut, the control worker and two GPU workers with
emulator engines; a seeded schedule of worker SIGKILLs, engine SIGKILLs and SIGSTOPs, Redis
client kills, one Redis restart and S3 outages, placed per 1,000 prompts completed (each fault
fires when the run's count of prompts completed reaches its point). The same fleet first runs
the data without faults, then a second copy of it (other ids) under the schedule; both must end
with every prompt exactly once and no batch parked. Goodput is prompts exported per second of
wall time, from enqueue to the last output object.

    python bench/chaos.py            # 3,200 prompts, 7 faults per 1,000 (24 faults, seed 4)
    python bench/chaos.py --quick    # 1,800 prompts, the same rate (15 faults, seed 4)

The goal: `goodput_vs_clean >= 0.85` and generated tokens redone at most 5 % of the tokens
kept, every prompt exactly once.

Every engine keeps a request log (`harness/resends.py`) and a count of the tokens it drew, so
the chaos run prints per fault kind the prompts it sent to an engine again and the generated
tokens redone: tokens the engines generated that no exported answer holds
(`harness/redone.py`: every engine's tokens less the records' completion tokens, charged to
the fault that threw them away), with how many answers went on from the ids they had drawn
(records with `resumed_tokens`) and how many started over (`restarted`). And each GPU worker's
engine is read twice a second (its process, and `num_running_reqs` from its /metrics): each run
prints its engine-seconds by how full the engines were (no engine: dead, starting or frozen;
idle; a quarter full or less; three quarters; more), and the chaos run its engine-seconds with
no engine per fault kind (a look charged to the last fault that hit its worker, or that started
it in a killed one's place). With `--timeline` the chaos run is also printed second by second:
each GPU worker's engine (requests running, `down` or `frozen`), the machine's CPU busy share
and the faults played in that second. Both runs print the CPU time the whole machine used
(from /proc/stat): a run that leaves the cores idle is bound by its engines' fill, not by
this machine's CPU.

The last line is `goodput_vs_clean: R`, chaos goodput over clean goodput.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import logging
import math
import os
import secrets
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import NamedTuple

import httpx
import redis

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from genfleet.common import keys  # noqa: E402
from genfleet.common.routing import worker_queue  # noqa: E402
from genfleet.workers.observe.engine_state import engine_state_from_metrics  # noqa: E402
from harness.chaos import (  # noqa: E402
    FAULTS_PER_1000,
    WORKER_SETTINGS,
    Fleet,
    Played,
    SoakResult,
    fleet,
    soak_run,
)
from harness.redone import Redone, engine_tokens, redone_tokens, since  # noqa: E402
from harness.resends import Sends, attribute, log_name  # noqa: E402

FILLS = ("no engine", "idle", "<=25%", "<=75%", ">75%")
GOAL_GOODPUT, GOAL_REDONE_SHARE = 0.85, 0.05
# The fault rate (harness/chaos.py) was set on a clean quick run of this long; a faster fleet
# runs more prompts for it, so that its faults come no closer together in time.
REFERENCE_CLEAN_S = 69.0
# 1,600 prompts made a clean run of 63-65 s once slots went on by the engine's room.
QUICK_PROMPTS = 1800


def fill(running: int | None, cap: int) -> str:
    """The bin of one engine's look (`cap`: its max running requests); `running` is None
    when it has no serving process."""
    if running is None:
        return "no engine"
    if running == 0:
        return "idle"
    return "<=25%" if 4 * running <= cap else "<=75%" if 4 * running <= 3 * cap else ">75%"


TICKS = os.sysconf("SC_CLK_TCK")


def cpu_jiffies() -> tuple[float, float]:
    """The machine's CPU time so far as (busy, all) jiffies summed over its cores, from the
    first line of /proc/stat (idle and iowait count as not busy)."""
    fields = [float(v) for v in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    return sum(fields) - fields[3] - fields[4], sum(fields)


def engine_of(worker_pid: int) -> tuple[int, str] | None:
    """The engine of the worker `worker_pid` (its child that leads a session of its own: the
    supervisor starts every engine so) as its pid and process state (`R`, `S`, `T` when
    SIGSTOPped), or None while it has none."""
    for stat in Path("/proc").glob("[0-9]*/stat"):
        with contextlib.suppress(OSError, ValueError):
            state, parent, _, session = stat.read_text().rsplit(")", 1)[1].split()[:4]
            pid = int(stat.parent.name)
            if int(parent) == worker_pid and int(session) == pid and state != "Z":
                return pid, state
    return None


class Look(NamedTuple):
    """One look at a worker's engine: what it was doing (requests running, "down" or
    "frozen") and its cap."""

    at: float  # monotonic
    worker: str
    state: str
    cap: int

    @property
    def bin(self) -> str:
        return fill(int(self.state) if self.state.isdigit() else None, self.cap)


class EngineTimeline(threading.Thread):
    """Looks at every GPU worker's engine every `every_s` until stopped: (time, bin) pairs."""

    def __init__(self, soak: Fleet, api_key: str, every_s: float = 0.5) -> None:
        super().__init__(name="engine-timeline", daemon=True)
        self.soak = soak
        self.every_s = every_s
        self.looks: list[Look] = []
        self.queued: list[tuple[float, int]] = []  # (monotonic, work orders waiting)
        self.cpu: list[tuple[float, float, float]] = []  # (monotonic, busy, all) jiffies
        self.stopped = threading.Event()
        self._http = httpx.Client(
            timeout=0.4, headers={"Authorization": f"Bearer {api_key}"}, trust_env=False
        )

    def run(self) -> None:
        with self._http:
            while not self.stopped.wait(self.every_s):
                now = time.monotonic()
                self.cpu.append((now, *cpu_jiffies()))
                self.queued.append((now, self._queued()))
                for worker in list(self.soak.workers):
                    if worker.proc.poll() is None:
                        state, cap = self._look(engine_of(worker.proc.pid))
                        self.looks.append(Look(now, worker.hostname, state, cap))

    def _queued(self) -> int:
        """Work orders waiting in the run's queue (-1 while Redis cannot be asked)."""
        try:
            with self.soak.redis.client() as client:
                names = keys.broker_queue_keys(worker_queue(self.soak.settings()))
                return sum(int(client.llen(name)) for name in names)
        except redis.RedisError:
            return -1

    def _look(self, engine: tuple[int, str] | None) -> tuple[str, int]:
        """What `engine` (its pid and process state) is doing (requests running, "down" when
        it is gone or not answering, "frozen" when SIGSTOPped) and its cap."""
        if engine is None:
            return "down", 1
        pid, process_state = engine
        try:
            argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
            port = int(argv[argv.index(b"--port") + 1])
            cap = int(argv[argv.index(b"--max-running-requests") + 1])
            if process_state == "T":
                return "frozen", cap
            text = self._http.get(f"http://127.0.0.1:{port}/metrics").text
        except (OSError, ValueError, IndexError, httpx.HTTPError):
            return "down", 1
        running = engine_state_from_metrics(text).get("running")
        return ("down" if running is None else str(int(running))), cap

    def busy(self, start: float, end: float) -> float:
        """The machine's CPU time used between `start` and `end` (monotonic), in
        core-seconds."""
        inside = [busy for at, busy, _ in self.cpu if start <= at <= end]
        return (inside[-1] - inside[0]) / TICKS if len(inside) > 1 else 0.0

    def seconds(self, start: float, end: float) -> dict[str, float]:
        """Engine-seconds between `start` and `end` (monotonic) in each bin."""
        counts = collections.Counter(look.bin for look in self.looks if start <= look.at <= end)
        return {name: counts[name] * self.every_s for name in FILLS}


def show_timeline(
    looks: list[Look],
    queued: list[tuple[float, int]],
    cpu: list[tuple[float, float, float]],
    played: list[Played],
    start: float,
    wall_start: float,
) -> None:
    """One line per second from `start` (monotonic; `wall_start` the same moment on the wall
    clock the faults were stamped with): the work orders waiting and each worker's engine at
    the second's last look, then the faults played in it. Workers are numbered in the order
    they first appear."""
    waiting = {int(at - start): count for at, count in queued if at >= start}
    busy: dict[int, int] = {}  # the machine's CPU busy share (%) in each second
    for (at, busy0, all0), (_, busy1, all1) in zip(cpu, cpu[1:], strict=False):
        if at >= start and all1 > all0:
            busy[int(at - start)] = round(100 * (busy1 - busy0) / (all1 - all0))
    names: dict[str, str] = {}
    seconds: dict[int, dict[str, str]] = collections.defaultdict(dict)
    for at, worker, state, _ in looks:
        if at >= start:
            names.setdefault(worker, f"w{len(names)}")
            seconds[int(at - start)][worker] = state
    faults: dict[int, list[str]] = collections.defaultdict(list)
    for fault in played:
        target = f" {names.setdefault(fault.target, f'w{len(names)}')}" if fault.target else ""
        faults[int(fault.at_s - wall_start)].append(f"{fault.action}{target}")
    print(
        "chaos timeline (s: orders waiting, the machine's CPU busy %, each worker's engine, "
        "requests running; then the faults):"
    )
    for second in range(max([*seconds, *faults], default=-1) + 1):
        engines = "  ".join(f"{names[w]} {s:>6}" for w, s in seconds.get(second, {}).items())
        cpu_share = busy.get(second, -1)
        line = f"{second:4d}  q {waiting.get(second, -1):>3}  cpu {cpu_share:>3}  {engines:<34}"
        print(f"{line}{'  '.join(faults.get(second, []))}".rstrip())


def show(run: str, seconds: dict[str, float]) -> None:
    total = sum(seconds.values()) or 1.0
    parts = ", ".join(f"{k} {v:.1f} ({100 * v / total:.0f} %)" for k, v in seconds.items())
    print(f"{run}: engine-seconds by fill: {parts}", flush=True)


def no_engine_by_fault(
    looks: list[Look], played: list[Played], start: float, wall_start: float, every_s: float
) -> collections.Counter[str]:
    """Engine-seconds with no engine (dead, starting, frozen) from `start` (monotonic; the
    same moment `wall_start` on the faults' wall clock), each look charged to the last fault
    before it that hit its worker or started it in a killed one's place (`none`: no fault)."""
    seconds: collections.Counter[str] = collections.Counter()
    for look in looks:
        if look.at < start or look.bin != "no engine":
            continue
        at_s = wall_start + look.at - start
        hit = [f for f in played if f.at_s <= at_s and look.worker in (f.target, f.started)]
        seconds[hit[-1].action if hit else "none"] += every_s
    return seconds


def kept_tokens(result: SoakResult) -> int:
    """The completion tokens of the run's exported answers."""
    return sum(
        int((row.get("usage") or {}).get("completion_tokens") or 0)
        for row in result.rows
        if row.get("error") is None
    )


def same_as_clean(clean: SoakResult, chaos: SoakResult) -> tuple[int, list[str]]:
    """How many of the chaos run's answers are the clean run's answer to the same text, and
    the ids of the others. Both runs send the same texts (ids `clean-i`, `chaos-i`), and the
    emulator draws an answer as a function of its prompt alone: an answer gone on from ids
    that were not its own draw's (two tries' ids mixed, a piece of text lost or doubled across
    a cut) is not the clean one."""
    by_index = {row["id"].rsplit("-", 1)[1]: row for row in clean.rows}
    same, other = 0, []
    for row in chaos.rows:
        twin = by_index.get(row["id"].rsplit("-", 1)[1])
        fields = ("reasoning", "content", "finish_reason")
        if twin is not None and all(row.get(f) == twin.get(f) for f in fields):
            same += 1
        else:
            other.append(row["id"])
    return same, other


def answers_after_cuts(result: SoakResult) -> str:
    """How many answers went on from their ids (and the tokens carried), how many started over
    and why."""
    resumed = [int(row.get("resumed_tokens") or 0) for row in result.rows]
    went_on = [n for n in resumed if n > 0]
    restarted = [row["restarted"] for row in result.rows if row.get("restarted")]
    reasons = collections.Counter(str(r.get("reason")) for r in restarted)
    return (
        f"answers that went on from their ids: {len(went_on)} ({sum(went_on)} tokens carried); "
        f"answers that started over: {len(restarted)} "
        f"({sum(int(r.get('tokens') or 0) for r in restarted)} tokens), {dict(reasons)}"
    )


def show_costs(
    played: list[Played],
    resent: collections.Counter[str],
    redone: Redone,
    kept: int,
    no_engine: collections.Counter[str],
) -> None:
    """Per fault kind: how many were played, prompts sent again, tokens redone (and their
    share of the tokens kept), engine-seconds with no engine."""
    kinds = collections.Counter(f.action for f in played)
    names = sorted({*kinds, *resent, *redone.by_cause, *no_engine}, key=lambda k: -kinds[k])
    print("fault kind        played  sent again  tokens redone  of kept  no-engine s")
    for name in names:
        tokens = redone.by_cause[name]
        print(
            f"{name:<17} {kinds[name]:>6}  {resent[name]:>10}  {tokens:>13,}  "
            f"{100 * tokens / max(kept, 1):>6.2f} %  {no_engine[name]:>11.1f}"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="1,800 prompts (about 4 min)")
    parser.add_argument("--prompts", type=int, help="the run's size (default 3,200; 1,800 quick)")
    parser.add_argument("--faults-per-1000", type=float, default=FAULTS_PER_1000)
    parser.add_argument("--seed", type=int, default=4)
    parser.add_argument(
        "--checkpoint-interval-s",
        type=float,
        help=f"the workers' (default {WORKER_SETTINGS['checkpoint_interval_s']}, harness/chaos.py)",
    )
    parser.add_argument(
        "--timeline", action="store_true", help="print the chaos run second by second"
    )
    args = parser.parse_args()
    prompts = args.prompts or (QUICK_PROMPTS if args.quick else 3200)
    logging.getLogger("werkzeug").setLevel(logging.WARNING)
    root = Path(tempfile.mkdtemp(prefix="genfleet-chaos-bench-"))

    api_key = secrets.token_hex(16)

    def request_log(hostname: str) -> dict[str, str]:
        return {
            "GENFLEET_EMULATOR_REQUEST_LOG": str(root / log_name(hostname)),
            "GENFLEET_ENGINE_API_KEY": api_key,  # the timeline reads the engines' /metrics
        }

    overrides = {}
    if args.checkpoint_interval_s is not None:
        overrides["checkpoint_interval_s"] = args.checkpoint_interval_s
    with fleet(root, extra_env=request_log, overrides=overrides) as soak:
        timeline = EngineTimeline(soak, api_key)
        timeline.start()
        started = time.monotonic()
        tokens_before = engine_tokens(root)
        clean = soak_run(soak, "clean", prompts, None, deadline_s=900.0)
        ended = time.monotonic()
        show("clean", timeline.seconds(started, ended))
        cpu_clean = timeline.busy(started, ended)
        sends = Sends(root)
        sends.read()  # the clean run's sends: both runs send the same texts
        before = {text: len(sent) for text, sent in sends.by_prompt.items()}
        tokens_clean = engine_tokens(root)
        clean_kept = kept_tokens(clean)
        clean_generated = sum(since(tokens_clean, tokens_before).values())
        print(
            f"clean: {clean.prompts} prompts in {clean.seconds:.1f} s "
            f"({clean.prompts_per_s:.2f} prompts/s); tokens generated {clean_generated:,}, "
            f"kept {clean_kept:,}",
            flush=True,
        )
        if clean.seconds < REFERENCE_CLEAN_S:
            longer = math.ceil(prompts * REFERENCE_CLEAN_S / clean.seconds / 100) * 100
            print(
                f"clean: shorter than the {REFERENCE_CLEAN_S:.0f} s the fault rate was set on: "
                f"its faults come closer together than the goal's; --prompts {longer} meets it",
                flush=True,
            )
        started, wall_started = time.monotonic(), time.time()
        chaos = soak_run(
            soak, "chaos", prompts, args.seed, deadline_s=1200.0, per_1000=args.faults_per_1000
        )
        ended = time.monotonic()
        show("chaos", timeline.seconds(started, ended))
        cpu_chaos = timeline.busy(started, ended)
        print(
            f"CPU used (core-seconds, the whole machine): clean {cpu_clean:.1f}, "
            f"chaos {cpu_chaos:.1f}",
            flush=True,
        )
        timeline.stopped.set()
        timeline.join()
        if args.timeline:
            show_timeline(
                timeline.looks, timeline.queued, timeline.cpu, soak.played, started, wall_started
            )
        print(
            f"chaos (seed {args.seed}, {args.faults_per_1000:g} faults per 1,000 prompts): "
            f"{chaos.prompts} prompts in {chaos.seconds:.1f} s "
            f"({chaos.prompts_per_s:.2f} prompts/s) through {len(chaos.actions)} faults: "
            f"{', '.join(chaos.actions)}",
            flush=True,
        )
        sends.read()
        chaotic = [sent[before.get(text, 0) :] for text, sent in sends.by_prompt.items()]
        resent = attribute(chaotic, soak.played)
        generated = since(engine_tokens(root), tokens_clean)
        redone = redone_tokens(chaotic, sends.ended, generated, soak.played)
        no_engine = no_engine_by_fault(
            timeline.looks, soak.played, started, wall_started, timeline.every_s
        )
    kept = kept_tokens(chaos)
    total = sum(generated.values())
    show_costs(soak.played, resent, redone, kept, no_engine)
    share = (total - kept) / max(kept, 1)
    print(
        f"tokens: generated {total:,}, kept {kept:,} (the answers' view: {redone.kept:,}), "
        f"redone {total - kept:,} ({100 * share:.2f} % of kept; by cause above: "
        f"{redone.total:,}; inconsistent {redone.inconsistent})"
    )
    print(answers_after_cuts(chaos))
    same, other = same_as_clean(clean, chaos)
    print(
        f"answers identical to the clean run's: {same} of {len(chaos.rows)} (others: {other[:5]})"
    )
    goodput = chaos.prompts_per_s / clean.prompts_per_s
    met = goodput >= GOAL_GOODPUT and share <= GOAL_REDONE_SHARE and not other
    print(
        f"goal (goodput_vs_clean >= {GOAL_GOODPUT}, redone <= {100 * GOAL_REDONE_SHARE:g} % "
        f"of kept, every prompt once and as drawn clean): {'met' if met else 'not met'}"
    )
    print(f"goodput_vs_clean: {goodput:.3f}")


if __name__ == "__main__":
    main()
