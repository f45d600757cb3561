"""Goodput under chaos, as a ratio to a fault-free run of the same data on the same fleet.

The fleet and the fault schedule are `harness/chaos.py`'s: a private redis-server (AOF
on), moto S3 behind a proxy that can be cut, the control worker and two GPU workers with
emulator engines; a seeded schedule of worker SIGKILLs, engine SIGKILLs and SIGSTOPs, Redis
client kills, one Redis restart and S3 outages. The same fleet first runs the data without
faults, then a second copy of it (other ids) under the schedule; both must end with every
prompt exactly once and no batch parked. Goodput is prompts exported per second of wall time,
from enqueue to the last output object.

    python bench/chaos.py            # 1,800 prompts, 160 s of faults
    python bench/chaos.py --quick    # the test's soak: 900 prompts, 80 s of faults, seed 4

Every engine keeps a request log (`harness/resends.py`), so the prompts the chaos run sent
to an engine again are printed per fault that caused them. And each GPU worker's engine is
read twice a second (its process, and `num_running_reqs` from its /metrics): each run prints
its engine-seconds by how full the engines were, so where the chaos run's time goes shows
(no engine: dead, starting or frozen; idle; a quarter full or less; three quarters; more).
With `--timeline` the chaos run is also printed second by second: each GPU worker's engine
(requests running, `down` or `frozen`) and the faults played in that second, so the seconds a
fault costs (an engine starting, a frozen engine holding the last prompts) can be read off.

The last line is `goodput_vs_clean: R`, chaos goodput over clean goodput.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import logging
import secrets
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import NamedTuple

import httpx

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from genfleet.workers.observe.engine_state import engine_state_from_metrics  # noqa: E402
from harness.chaos import Fleet, Played, fleet, soak_run  # noqa: E402
from harness.resends import Sends, attribute, log_name  # noqa: E402

FILLS = ("no engine", "idle", "<=25%", "<=75%", ">75%")


def fill(running: int | None, cap: int) -> str:
    """The bin of one engine's look (`cap`: its max running requests); `running` is None
    when it has no serving process."""
    if running is None:
        return "no engine"
    if running == 0:
        return "idle"
    return "<=25%" if 4 * running <= cap else "<=75%" if 4 * running <= 3 * cap else ">75%"


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
        self.stopped = threading.Event()
        self._http = httpx.Client(
            timeout=0.4, headers={"Authorization": f"Bearer {api_key}"}, trust_env=False
        )

    def run(self) -> None:
        with self._http:
            while not self.stopped.wait(self.every_s):
                now = time.monotonic()
                for worker in list(self.soak.workers):
                    if worker.proc.poll() is None:
                        state, cap = self._look(engine_of(worker.proc.pid))
                        self.looks.append(Look(now, worker.hostname, state, cap))

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

    def seconds(self, start: float, end: float) -> dict[str, float]:
        """Engine-seconds between `start` and `end` (monotonic) in each bin."""
        counts = collections.Counter(look.bin for look in self.looks if start <= look.at <= end)
        return {name: counts[name] * self.every_s for name in FILLS}


def show_timeline(looks: list[Look], played: list[Played], start: float, wall_start: float) -> None:
    """One line per second from `start` (monotonic; `wall_start` the same moment on the wall
    clock the faults were stamped with): each worker's engine at the second's last look, then
    the faults played in it. Workers are numbered in the order they first appear."""
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
    print("chaos timeline (s: each worker's engine, requests running; then the faults):")
    for second in range(max([*seconds, *faults], default=-1) + 1):
        engines = "  ".join(f"{names[w]} {s:>6}" for w, s in seconds.get(second, {}).items())
        print(f"{second:4d}  {engines:<34}{'  '.join(faults.get(second, []))}".rstrip())


def show(run: str, seconds: dict[str, float]) -> None:
    total = sum(seconds.values()) or 1.0
    parts = ", ".join(f"{k} {v:.1f} ({100 * v / total:.0f} %)" for k, v in seconds.items())
    print(f"{run}: engine-seconds by fill: {parts}", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="the test's soak (about 5 min)")
    parser.add_argument("--seed", type=int, default=4)
    parser.add_argument(
        "--timeline", action="store_true", help="print the chaos run second by second"
    )
    args = parser.parse_args()
    prompts, duration_s = (900, 80.0) if args.quick else (1800, 160.0)
    logging.getLogger("werkzeug").setLevel(logging.WARNING)
    root = Path(tempfile.mkdtemp(prefix="genfleet-chaos-bench-"))

    api_key = secrets.token_hex(16)

    def request_log(hostname: str) -> dict[str, str]:
        return {
            "GENFLEET_EMULATOR_REQUEST_LOG": str(root / log_name(hostname)),
            "GENFLEET_ENGINE_API_KEY": api_key,  # the timeline reads the engines' /metrics
        }

    with fleet(root, extra_env=request_log) as soak:
        timeline = EngineTimeline(soak, api_key)
        timeline.start()
        started = time.monotonic()
        clean = soak_run(soak, "clean", prompts, None, 0.0, deadline_s=600.0)
        show("clean", timeline.seconds(started, time.monotonic()))
        sends = Sends(root)
        sends.read()  # the clean run's sends: both runs send the same texts
        before = {text: len(sent) for text, sent in sends.by_prompt.items()}
        print(
            f"clean: {clean.prompts} prompts in {clean.seconds:.1f} s "
            f"({clean.prompts_per_s:.2f} prompts/s)",
            flush=True,
        )
        started, wall_started = time.monotonic(), time.time()
        chaos = soak_run(soak, "chaos", prompts, args.seed, duration_s, deadline_s=900.0)
        show("chaos", timeline.seconds(started, time.monotonic()))
        timeline.stopped.set()
        timeline.join()
        if args.timeline:
            show_timeline(timeline.looks, soak.played, started, wall_started)
        print(
            f"chaos (seed {args.seed}): {chaos.prompts} prompts in {chaos.seconds:.1f} s "
            f"({chaos.prompts_per_s:.2f} prompts/s) through {len(chaos.actions)} faults: "
            f"{', '.join(chaos.actions)}",
            flush=True,
        )
        sends.read()
        chaotic = [sent[before.get(text, 0) :] for text, sent in sends.by_prompt.items()]
        redone = attribute(chaotic, soak.played)
        print(f"prompts sent again, by cause: {dict(redone.most_common())}", flush=True)
    print(f"goodput_vs_clean: {chaos.prompts_per_s / clean.prompts_per_s:.3f}")


if __name__ == "__main__":
    main()
