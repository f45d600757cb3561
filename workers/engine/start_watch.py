"""Whether a starting engine moves: its process group's CPU time and its log.

The stall watchdog (workers/engine/watchdog.py) judges an engine that serves. One frozen while
it starts (a stopped process, one blocked on something that never comes) answers no health
check and says nothing: its worker waited out the whole `startup_timeout_s` (an hour by
default, sized for a big checkpoint's load) with its GPU idle, then the stop's SIGTERM grace.
A start that moves spends CPU time or writes its log: reading weights, building kernels,
capturing graphs, even a download or a file lock polled. One that did neither for the stall
timeout is frozen; the supervisor kills it and starts another, as it restarts a dead engine.
Where the CPU time cannot be read (no /proc) nothing is judged: a quiet log alone is not a
frozen start.

    progress = StartProgress(window_s=300, since_s=time.monotonic())
    progress.look(time.monotonic(), group_cpu_s(pid), lines)  # True: frozen for 300 s
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

PROC = Path("/proc")
TICKS_PER_S = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def group_cpu_s(pgid: int, proc: Path = PROC) -> float | None:
    """The CPU seconds (user + system) the live processes of group `pgid` used so far; None
    where /proc does not tell (another system, or no process of the group left)."""
    total, seen = 0, False
    try:
        entries = list(proc.iterdir())
    except OSError:
        return None
    for entry in entries:
        if not entry.name.isdigit():
            continue
        try:
            data = (entry / "stat").read_bytes()
        except OSError:
            continue  # gone since the listing
        # The command name (2nd field) may hold spaces and parentheses: count after its end.
        fields = data[data.rfind(b")") + 2 :].split()
        if len(fields) < 13 or int(fields[2]) != pgid:  # fields[2]: pgrp (the 5th field)
            continue
        seen = True
        total += int(fields[11]) + int(fields[12])  # utime, stime (14th, 15th) in ticks
    return total / TICKS_PER_S if seen else None


@dataclass(slots=True)
class StartProgress:
    """When a starting engine last moved (pure: the caller reads the clock, the CPU time and
    its log's line count)."""

    window_s: float
    since_s: float  # when it last moved; its spawn at first
    cpu_s: float | None = None
    lines: int = 0

    def look(self, now_s: float, cpu_s: float | None, lines: int) -> bool:
        """Note one look; True when it has neither used CPU time nor written a log line for
        `window_s`. Never True while the CPU time cannot be read.

        >>> p = StartProgress(10, since_s=0)
        >>> p.look(5, 1.0, 3), p.look(14, 1.0, 3), p.look(16, 1.0, 3)
        (False, False, True)
        >>> p.look(17, 1.01, 3), p.look(30, None, 3)
        (False, False)
        """
        moved = lines != self.lines or (
            cpu_s is not None and (self.cpu_s is None or cpu_s > self.cpu_s)
        )
        if moved:
            self.since_s = now_s
        self.lines = lines
        if cpu_s is None:
            return False
        self.cpu_s = cpu_s
        return now_s - self.since_s >= self.window_s
