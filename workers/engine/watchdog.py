"""Judging an engine by progress, not by its pid: the stall watchdog.

An engine can stop answering without exiting (a decode hang under thousands of requests, an
event-loop stall, a CUDA error that leaves the process alive, a `kill -STOP`). Its requests
then wait for `request_timeout_s` and the supervisor, which only watches the pid, never
notices. So a thread of the worker watches two things while requests are in flight:

- progress: completions the client received, plus the engine's own generated-token counters
  from `/metrics` (`sglang:generation_tokens_total`, `sglang:realtime_tokens_total`);
- after a window without any, a `/health_generate` probe (SGLang generates one token for
  it). Only when that fails too is the engine stalled, and `on_stall` gets the figures.
  The probe is sent through the window's last `probe_timeout_s` (`probe_due`), so a probe
  that times out has its answer as the window closes: sent after it, its own timeout was
  added to every stall (2 of the 10-12 s a frozen engine was held in the chaos bench). One
  that fails a moment before the window closes stands, unless the engine moves by the close:
  probed again there, a frozen engine was held a probe timeout more (9 s of a 6-s window).

The window is `stall_timeout_s` while the engine is young: its first minutes may hold pauses
no later minute does (kernels compiled for a shape seen the first time). Once it has moved
for a whole `stall_timeout_s`, the window follows what it showed: `GAP_FACTOR` times the
longest pause it made with requests in flight, never under `FLOOR_SHARE` of `stall_timeout_s`
nor over it (`stall_window_s`). A busy engine that paused at most a second in an hour is not
given five minutes to prove that it hangs: at the default 300 s a hang is found after 75 s,
not 300 s, and each hang costs the GPU that much less. The probe still decides: a healthy
engine in an unusually long pause answers it and is left alone.

A restarted engine is young again, but not unknown: the same command on the same card
already showed, over a whole life that included its own young minutes and its first burst
of requests, the longest pause such an engine makes. So a process started after one that
had matured inherits that pause (`StallClock.learned_pause_s`, the longest over the
worker's matured engines) and is judged by it from its first request, its own pauses added
as it makes them. Without it an engine restarted seconds before a hang got the whole
timeout: in the chaos bench, 8 s against the 3-4 s of a mature one, on every freeze that
followed a restart.

An engine that, requests in flight, neither moves nor uses CPU time is not slow but stopped:
a process that computes, waits on its GPU (the CUDA runtime spins) or polls its queues spends
CPU time every look, and one starved by a busy machine still gets its turns. A stopped
process (`kill -STOP`, a frozen cgroup), one deadlocked on a lock, or one stuck in the kernel
on a hung device spends none. Where the process group's CPU time can be read, an engine
still in both for `CPU_STILL_S` is stalled without waiting for the window or a probe (a
stopped process answers none; its timeout only added to the stall): in the chaos bench a
frozen engine was held 4-6 s by windows of four times the pauses a CPU-bound machine made.
An engine that spins without moving (a GPU hang the CUDA runtime polls) still uses CPU time
and is judged by the window and the probe as before.

The decision is the pure `advance()`; the thread only gathers its inputs.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

import httpx

log = logging.getLogger("genfleet.engine")

# The counters of SGLang's /metrics that move as the engine generates (contract §3).
PROGRESS_COUNTERS = ("sglang:generation_tokens_total", "sglang:realtime_tokens_total")


# The window once the engine is past its young minutes: this many times its longest pause...
GAP_FACTOR = 4.0
# ... but never under this share of `stall_timeout_s` (nor over all of it).
FLOOR_SHARE = 0.25
# Still and no CPU time for this long, requests in flight: stopped (module docstring). A
# process that runs spends a clock tick (10 ms) within a look (0.5-2 s) many times over.
CPU_STILL_S = 2.0


@dataclass(frozen=True)
class StallClock:
    """When the engine was last seen moving (or idle), the progress figures then, and what
    its pauses were: when it first moved with requests in flight, and the longest stretch
    it went without moving while they were (to a look's resolution)."""

    moved_at: float
    progress: tuple[float, ...] = ()
    first_moved_at: float | None = None
    longest_pause_s: float = 0.0
    incarnation: int = 0  # which start of the engine this clock judges (its restarts so far)
    # The longest pause of the earlier engines of this worker that matured (module docstring);
    # None while none has.
    learned_pause_s: float | None = None
    # The engine's process group CPU seconds at the last look that found them risen, and
    # when that was (None: not read, or unreadable: no CPU verdict).
    cpu_s: float | None = None
    cpu_at: float | None = None

    def stalled_s(self, now: float) -> float:
        return max(0.0, now - self.moved_at)

    def mature(self, now: float, stall_timeout_s: float) -> bool:
        """Whether this engine has moved for a whole `stall_timeout_s`: past its young
        minutes, its pauses are what such an engine does."""
        return self.first_moved_at is not None and now - self.first_moved_at >= stall_timeout_s

    def restarted(
        self, now: float, stall_timeout_s: float, incarnation: int | None = None
    ) -> StallClock:
        """The clock for a new engine process: young again, no pause of its own known; what
        a matured predecessor paused at most is kept as learned.

        >>> old = StallClock(0.0, (), first_moved_at=1.0, longest_pause_s=2.0)
        >>> old.restarted(5.0, 8.0).learned_pause_s, old.restarted(9.0, 8.0).learned_pause_s
        (None, 2.0)
        """
        learned = self.learned_pause_s
        if self.mature(now, stall_timeout_s):
            learned = max(learned or 0.0, self.longest_pause_s)
        return StallClock(
            now,
            self.progress,
            incarnation=self.incarnation if incarnation is None else incarnation,
            learned_pause_s=learned,
        )


def looked_at(
    clock: StallClock, now: float, ready: bool, incarnation: int, stall_timeout_s: float
) -> StallClock:
    """The clock as a look finds the engine: one not ready, or started again since the last
    look (`incarnation`, its restart count, moved: a restart quicker than a look), is a new
    process, young again. Its own pauses start from none; a matured predecessor's are kept
    as learned (`StallClock.restarted`).

    >>> warm = StallClock(0.0, (), first_moved_at=1.0, longest_pause_s=2.0, incarnation=3)
    >>> looked_at(warm, 5.0, True, 3, 8.0) is warm
    True
    >>> new = looked_at(warm, 9.0, True, 4, 8.0)
    >>> new.longest_pause_s, new.first_moved_at, new.learned_pause_s
    (0.0, None, 2.0)
    """
    if ready and incarnation == clock.incarnation:
        return clock
    return clock.restarted(now, stall_timeout_s, incarnation)


def advance(
    clock: StallClock,
    now: float,
    inflight: int,
    progress: tuple[float, ...],
    cpu_s: float | None = None,
) -> StallClock:
    """The clock after one look: reset when nothing is in flight or any figure moved; a
    move with requests in flight ends a pause, whose length is kept when it is the longest.
    `cpu_s`, the engine's CPU seconds with requests in flight (None: unreadable), is kept
    with the look that last found it risen: about when the engine last ran.

    >>> c = advance(StallClock(0.0, (5.0,)), 10.0, inflight=3, progress=(5.0,))
    >>> c.stalled_s(10.0)
    10.0
    >>> m = advance(c, 12.0, inflight=3, progress=(6.0,))
    >>> m.stalled_s(12.0), m.longest_pause_s, m.first_moved_at
    (0.0, 12.0, 12.0)
    >>> s = advance(m, 13.0, inflight=3, progress=(6.0,), cpu_s=4.0)
    >>> advance(s, 14.0, 3, (6.0,), cpu_s=4.0).cpu_at, advance(s, 14.0, 3, (6.0,), 4.5).cpu_at
    (13.0, 14.0)
    """
    if inflight <= 0:
        return replace(clock, moved_at=now, progress=progress, cpu_s=None, cpu_at=None)
    if progress != clock.progress:
        clock = replace(moved(clock, now), progress=progress)
    if cpu_s is None:
        return replace(clock, cpu_s=None, cpu_at=None) if clock.cpu_s is not None else clock
    if clock.cpu_s is None or cpu_s > clock.cpu_s:
        return replace(clock, cpu_s=cpu_s, cpu_at=now)
    return clock


def cpu_still_s(clock: StallClock, now: float) -> float | None:
    """How long the still engine has used no CPU time (None: not known), counted from the
    look that last saw it rise, or from when it went still where that was later.

    >>> still = StallClock(10.0, (1.0,), cpu_s=4.0, cpu_at=11.0)
    >>> cpu_still_s(still, 13.5), cpu_still_s(StallClock(10.0), 13.5)
    (2.5, None)
    """
    if clock.cpu_s is None or clock.cpu_at is None:
        return None
    return now - max(clock.cpu_at, clock.moved_at)


def cpu_stopped(clock: StallClock, now: float, window_s: float) -> bool:
    """Whether the engine, still with requests in flight, has used no CPU time for
    `CPU_STILL_S` (or its whole window, where that is shorter): stopped, not slow.

    >>> still = StallClock(10.0, (1.0,), cpu_s=4.0, cpu_at=11.0)
    >>> cpu_stopped(still, 12.9, 6.0), cpu_stopped(still, 13.0, 6.0), cpu_stopped(still, 12.0, 1.0)
    (False, True, True)
    >>> cpu_stopped(StallClock(10.0), 30.0, 6.0)
    False
    """
    idle_s = cpu_still_s(clock, now)
    return idle_s is not None and idle_s >= min(CPU_STILL_S, window_s)


def moved(clock: StallClock, now: float) -> StallClock:
    """The engine showed at `now` that it works (it moved, or answered a probe): the pause
    it ends is one it may make again."""
    return replace(
        clock,
        moved_at=now,
        first_moved_at=now if clock.first_moved_at is None else clock.first_moved_at,
        longest_pause_s=max(clock.longest_pause_s, now - clock.moved_at),
    )


def stall_window_s(clock: StallClock, now: float, stall_timeout_s: float) -> float:
    """How long the engine may go without moving, requests in flight, before it is probed
    (module docstring): `stall_timeout_s` until it has moved for that long, then
    `GAP_FACTOR` times its longest pause, within [`FLOOR_SHARE`, 1] x `stall_timeout_s`.
    A young engine after a matured one is judged at once by the longer of the pause it
    learned from them and its own.

    >>> young = StallClock(0.0, (), first_moved_at=100.0, longest_pause_s=0.5)
    >>> stall_window_s(young, 200.0, 300.0), stall_window_s(young, 400.0, 300.0)
    (300.0, 75.0)
    >>> stall_window_s(replace(young, longest_pause_s=30.0), 400.0, 300.0)
    120.0
    >>> stall_window_s(replace(young, learned_pause_s=40.0), 200.0, 300.0)
    160.0
    """
    learned = clock.learned_pause_s
    if learned is None and not clock.mature(now, stall_timeout_s):
        return stall_timeout_s
    longest = max(clock.longest_pause_s, learned or 0.0)
    return min(stall_timeout_s, max(FLOOR_SHARE * stall_timeout_s, GAP_FACTOR * longest))


def probe_due(
    stalled_s: float, stall_timeout_s: float, probe_timeout_s: float, look_s: float = 0.0
) -> bool:
    """Whether an engine still for `stalled_s` (requests in flight) is probed now: once the
    probe, were it to time out, would end at the window's close, or would by the next look
    (`look_s` away: a look at a frozen engine also waits out its `/metrics` read); never
    before the window's first half is past or would be by the next look (a probe timeout as
    long as the window would otherwise probe a moving engine).

    >>> probe_due(5.9, 8.0, 2.0), probe_due(6.0, 8.0, 2.0), probe_due(275.0, 300.0, 25.0)
    (False, True, True)
    >>> probe_due(0.4, 1.0, 2.0), probe_due(0.5, 1.0, 2.0)
    (False, True)
    >>> probe_due(5.0, 8.0, 2.0, look_s=1.0), probe_due(2.0, 6.0, 3.0, look_s=1.5)
    (True, True)
    >>> probe_due(1.0, 6.0, 3.0, look_s=1.5)
    False
    """
    return stalled_s + look_s >= max(stall_timeout_s - probe_timeout_s, stall_timeout_s / 2)


def parse_counters(text: str, names: tuple[str, ...] = PROGRESS_COUNTERS) -> dict[str, float]:
    """Sum of each named counter over its label sets in a Prometheus text exposition."""
    found: dict[str, float] = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        name = line.split("{", 1)[0].split(" ", 1)[0]
        if name in names:
            with contextlib.suppress(ValueError, IndexError):
                found[name] = found.get(name, 0.0) + float(line.rsplit(" ", 1)[1])
    return found


@dataclass(frozen=True)
class WatchedEngine:
    """Where to look and what the client sees: the inputs of one watchdog."""

    base_url: str
    health_path: str
    headers: dict[str, str]
    inflight: Callable[[], int]
    completions: Callable[[], int]  # completion tokens the client has received
    ready: Callable[[], bool]
    incarnation: Callable[[], int] = lambda: 0  # the engine's restarts so far
    # The engine's process group CPU seconds (None: unknown, e.g. an engine not ours).
    cpu_s: Callable[[], float | None] = lambda: None


class StallWatchdog:
    """A daemon thread that calls `on_stall(figures)` once per stall it finds.

    After a stall the clock starts again: the restarted engine is young, judged by what its
    matured predecessors paused at most (the module docstring), else by the full timeout.
    """

    def __init__(
        self,
        engine: WatchedEngine,
        stall_timeout_s: float,
        on_stall: Callable[[dict[str, Any]], None],
        *,
        interval_s: float | None = None,
        probe_timeout_s: float | None = None,
    ) -> None:
        self.engine = engine
        self.stall_timeout_s = stall_timeout_s
        self.on_stall = on_stall
        # Fine enough to measure the engine's pauses: the window follows them.
        self.interval_s = interval_s or min(max(stall_timeout_s / 16, 0.5), 2.0)
        # A look at a frozen engine waits this out before it can probe: half an interval.
        self.metrics_timeout_s = self.interval_s / 2
        # SGLang's own health check gives up after 20 s (SGLANG_HEALTH_CHECK_TIMEOUT); half
        # the shortest window at most, so the probe fits in it.
        self.probe_timeout_s = probe_timeout_s or min(
            max(FLOOR_SHARE * stall_timeout_s / 2, 2.0), 25.0
        )
        self.stalls = 0
        self._metrics: dict[str, float] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="engine-watchdog", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(timeout=self.probe_timeout_s + 5)

    def _progress(self, client: httpx.Client) -> tuple[float, ...]:
        """Completions so far and the engine's counters (the last known when unreadable)."""
        with contextlib.suppress(httpx.HTTPError):
            response = client.get(
                self.engine.base_url + "/metrics",
                headers=self.engine.headers,
                timeout=self.metrics_timeout_s,
            )
            if response.status_code == 200:
                self._metrics.update(parse_counters(response.text))
        figures = [float(self.engine.completions())]
        figures.extend(self._metrics.get(name, -1.0) for name in PROGRESS_COUNTERS)
        return tuple(figures)

    def _look(self, clock: StallClock, client: httpx.Client, inflight: int) -> StallClock:
        """The clock after one look; the CPU time (a walk of /proc) is read while requests
        are in flight, so that a freeze is timed from the last look that saw the engine run,
        not the first that saw it still."""
        progress = self._progress(client)
        cpu = self.engine.cpu_s() if inflight > 0 else None
        return advance(clock, time.monotonic(), inflight, progress, cpu)

    def _probe(self, client: httpx.Client) -> str | None:
        """None when the engine generates (health 200), else what went wrong."""
        url = self.engine.base_url + self.engine.health_path
        try:
            response = client.get(url, headers=self.engine.headers, timeout=self.probe_timeout_s)
        except httpx.TimeoutException:
            return f"{self.engine.health_path} timed out after {self.probe_timeout_s:.0f} s"
        except httpx.HTTPError as exc:
            return f"{self.engine.health_path} failed: {type(exc).__name__}"
        if response.status_code == 200:
            return None
        return f"{self.engine.health_path} answered {response.status_code}"

    def _run(self) -> None:
        with httpx.Client() as client:
            clock = StallClock(time.monotonic(), incarnation=self.engine.incarnation())
            while not self._stop.wait(self.interval_s):
                ready = self.engine.ready()
                clock = looked_at(
                    clock,
                    time.monotonic(),
                    ready,
                    self.engine.incarnation(),
                    self.stall_timeout_s,
                )
                if not ready:
                    continue
                inflight = self.engine.inflight()
                clock = self._look(clock, client, inflight)
                now = time.monotonic()
                window_s = stall_window_s(clock, now, self.stall_timeout_s)
                cpu_idle_s = cpu_still_s(clock, now)
                by_cpu = cpu_stopped(clock, now, window_s)
                if by_cpu:
                    health: str | None = f"no CPU time for {cpu_idle_s or 0.0:.1f} s"
                elif (
                    cpu_idle_s is not None
                    and cpu_idle_s >= self.interval_s / 2
                    and clock.stalled_s(now) < window_s
                ):
                    # No CPU time since the last look either: the CPU time decides within
                    # CPU_STILL_S, where a probe of a stopped engine waits out its timeout.
                    # One that spins (its CPU time rose at this look) is probed as before.
                    continue
                else:
                    # The next look comes an interval on, and its /metrics read may time out.
                    look_s = self.interval_s + self.metrics_timeout_s
                    if not probe_due(clock.stalled_s(now), window_s, self.probe_timeout_s, look_s):
                        continue
                    health = self._probe(client)
                if health is None or self._stop.is_set():
                    # It answered: the pause was the engine's own, one to allow again.
                    clock = moved(clock, time.monotonic())
                    continue
                left_s = window_s - clock.stalled_s(time.monotonic())
                if left_s > 0 and not by_cpu:
                    # The probe failed a moment before the window closed (a look's
                    # granularity): its answer stands unless the engine moves by then.
                    # Probing again would add a whole probe timeout to every stall.
                    if self._stop.wait(left_s):
                        break
                    # Looked at again as any look does: an engine that died and was started
                    # again meanwhile is a new process, not the one the probe judged.
                    again = looked_at(
                        clock,
                        time.monotonic(),
                        self.engine.ready(),
                        self.engine.incarnation(),
                        self.stall_timeout_s,
                    )
                    if again is not clock:
                        clock = again
                        continue
                    clock = self._look(clock, client, inflight)
                    if clock.stalled_s(time.monotonic()) < window_s:
                        continue
                self.stalls += 1
                figures = {
                    "stalled_s": round(time.monotonic() - clock.moved_at, 1),
                    "stall_timeout_s": self.stall_timeout_s,
                    "stall_window_s": round(window_s, 1),
                    "longest_pause_s": round(clock.longest_pause_s, 1),
                    "learned_pause_s": (
                        None if clock.learned_pause_s is None else round(clock.learned_pause_s, 1)
                    ),
                    "cpu_still_s": None if cpu_idle_s is None else round(cpu_idle_s, 1),
                    "inflight": inflight,
                    "completions": self.engine.completions(),
                    "generation_tokens_total": self._metrics.get(PROGRESS_COUNTERS[0]),
                    "health": health,
                    "stalls": self.stalls,
                }
                try:
                    self.on_stall(figures)
                except Exception:  # noqa: BLE001 - the watchdog must outlive a failed reaction
                    log.exception("reacting to a stalled engine failed")
                clock = clock.restarted(time.monotonic(), self.stall_timeout_s)
