"""The stall decision as a table, and the Prometheus counters it reads."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from dataclasses import replace
from typing import Any

import pytest

from genfleet.workers.engine.start_watch import group_cpu_s
from genfleet.workers.engine.watchdog import (
    CPU_STILL_S,
    StallClock,
    StallWatchdog,
    WatchedEngine,
    advance,
    cpu_stopped,
    looked_at,
    moved,
    parse_counters,
    probe_due,
    stall_window_s,
)
from harness.env import free_port


@pytest.mark.parametrize(
    ("inflight", "before", "after", "stalled_s"),
    [
        (0, (5.0,), (5.0,), 0.0),  # idle is not stalled
        (3, (5.0,), (5.0,), 30.0),  # busy and nothing moved: the clock runs
        (3, (5.0,), (6.0,), 0.0),  # a completion came back
        (3, (5.0, 100.0), (5.0, 101.0), 0.0),  # the engine's token counter moved
        (3, (5.0, 100.0), (5.0, 100.0), 30.0),
    ],
)
def test_advance(
    inflight: int, before: tuple[float, ...], after: tuple[float, ...], stalled_s: float
) -> None:
    clock = advance(StallClock(0.0, before), 30.0, inflight, after)
    assert clock.stalled_s(30.0) == stalled_s


@pytest.mark.parametrize(
    ("stalled_s", "stall_timeout_s", "probe_timeout_s", "due"),
    [
        (5.9, 8.0, 2.0, False),  # the bench's window: probed from 6 s, answered by 8 s
        (6.0, 8.0, 2.0, True),
        (274.9, 300.0, 25.0, False),  # the default window and SGLang's health timeout
        (275.0, 300.0, 25.0, True),
        (0.4, 1.0, 2.0, False),  # a probe as long as the window waits for its second half
        (0.5, 1.0, 2.0, True),
        (0.0, 8.0, 2.0, False),  # a moving engine is never probed
    ],
)
def test_probe_due(
    stalled_s: float, stall_timeout_s: float, probe_timeout_s: float, due: bool
) -> None:
    assert probe_due(stalled_s, stall_timeout_s, probe_timeout_s) is due


def test_advance_keeps_the_first_still_moment() -> None:
    clock = StallClock(0.0, (1.0,))
    for now in (10.0, 20.0, 30.0):
        clock = advance(clock, now, 2, (1.0,))
    assert clock.stalled_s(30.0) == 30.0


def test_parse_counters_sums_label_sets_and_skips_others() -> None:
    text = (
        "# TYPE sglang:generation_tokens_total counter\n"
        'sglang:generation_tokens_total{engine_type="unified",model_name="m"} 5.0\n'
        'sglang:generation_tokens_total{engine_type="unified",model_name="n"} 2.0\n'
        'sglang:generation_tokens_totalx{model_name="m"} 99.0\n'
        "sglang:realtime_tokens_total 7\n"
        'sglang:num_running_reqs{tp_rank="0"} 3.0\n'
    )
    assert parse_counters(text) == {
        "sglang:generation_tokens_total": 7.0,
        "sglang:realtime_tokens_total": 7.0,
    }


@pytest.mark.parametrize(
    ("first_moved_at", "longest_pause_s", "now", "window_s"),
    [
        (None, 0.0, 1000.0, 300.0),  # never moved: the whole timeout
        (800.0, 0.5, 1000.0, 300.0),  # young: moved for 200 s of 300
        (700.0, 0.5, 1000.0, 75.0),  # moved 300 s, pauses of half a second: the floor
        (700.0, 30.0, 1000.0, 120.0),  # a 30-s pause seen (a long prefill): 4x it
        (700.0, 90.0, 1000.0, 300.0),  # never over the timeout
    ],
)
def test_the_stall_window_follows_the_engine_s_pauses_once_it_is_warm(
    first_moved_at: float | None, longest_pause_s: float, now: float, window_s: float
) -> None:
    clock = StallClock(now, (), first_moved_at, longest_pause_s)
    assert stall_window_s(clock, now, 300.0) == window_s


def test_pauses_are_measured_while_requests_are_in_flight_only() -> None:
    clock = StallClock(0.0, (1.0,))
    clock = advance(clock, 2.0, 4, (2.0,))  # moved: a 2-s pause, the first move
    clock = advance(clock, 60.0, 0, (2.0,))  # idle for a minute: no pause
    clock = advance(clock, 61.0, 4, (3.0,))
    assert (clock.first_moved_at, clock.longest_pause_s) == (2.0, 2.0)
    clock = advance(clock, 66.0, 4, (3.0,))  # still for 5 s ...
    clock = moved(clock, 66.5)  # ... then it answered a probe: its pause, allowed again
    assert clock.longest_pause_s == 5.5 and clock.stalled_s(66.5) == 0.0
    # a new process: young again (the old one had not matured: nothing learned)
    assert clock.restarted(70.0, 300.0) == StallClock(70.0, (3.0,))


WARM = StallClock(10.0, (3.0,), first_moved_at=1.0, longest_pause_s=0.5, incarnation=2)


@pytest.mark.parametrize(
    ("ready", "incarnation", "young"),
    [
        (True, 2, False),  # the same process, ready: its pauses stand
        (False, 2, True),  # starting: a new process
        (True, 3, True),  # restarted between two looks, ready at both: a new process too
    ],
)
def test_a_look_finds_a_new_engine_young_again(ready: bool, incarnation: int, young: bool) -> None:
    clock = looked_at(WARM, 400.0, ready, incarnation, 300.0)
    fresh = StallClock(400.0, (3.0,), incarnation=incarnation, learned_pause_s=0.5)
    assert (clock == fresh) is young
    assert clock.incarnation == incarnation
    # young after a matured engine: judged by what that one paused at most, at once
    assert stall_window_s(clock, 400.0, 300.0) == 75.0
    # an engine that had not matured teaches nothing: the whole timeout
    early = looked_at(WARM, 400.0, ready, incarnation, 1200.0)
    assert early.learned_pause_s is None
    assert stall_window_s(early, 400.0, 1200.0) == 1200.0


@pytest.mark.parametrize(
    ("life_s", "longest_pause_s", "learned_before", "learned_after", "window_s"),
    [
        (100.0, 0.5, None, None, 300.0),  # died young: nothing learned, the whole timeout
        (100.0, 0.5, 30.0, 30.0, 120.0),  # died young: what earlier ones taught stands
        (400.0, 20.0, None, 20.0, 80.0),  # matured: its longest pause (its youth included)
        (400.0, 2.0, 30.0, 30.0, 120.0),  # matured, paused less: never shrinks
        (400.0, 50.0, 30.0, 50.0, 200.0),  # matured, paused more: the longer
        (400.0, 90.0, None, 90.0, 300.0),  # never over the timeout
    ],
)
def test_a_restarted_engine_is_judged_by_what_matured_ones_paused(
    life_s: float,
    longest_pause_s: float,
    learned_before: float | None,
    learned_after: float | None,
    window_s: float,
) -> None:
    old = StallClock(
        life_s, (), 0.0, longest_pause_s, incarnation=1, learned_pause_s=learned_before
    )
    new = old.restarted(life_s, 300.0, incarnation=2)
    assert (new.learned_pause_s, new.first_moved_at, new.longest_pause_s) == (
        learned_after,
        None,
        0.0,
    )
    assert stall_window_s(new, life_s + 1.0, 300.0) == window_s
    # its own longer pauses count as it makes them (while young, only beside a learned one)
    paused = moved(replace(new, first_moved_at=life_s + 1.0, moved_at=life_s + 1.0), life_s + 71.0)
    own_s = 300.0 if learned_after is None else min(300.0, 4 * max(70.0, learned_after))
    assert stall_window_s(paused, life_s + 72.0, 300.0) == own_s


def never_moving(**watched: Any) -> WatchedEngine:
    """An engine with five requests in flight that never moves, on a port where nothing
    listens (its probe fails at once); `watched` overrides the rest (ready, incarnation,
    cpu_s)."""
    engine = WatchedEngine(
        base_url=f"http://127.0.0.1:{free_port()}",
        health_path="/health_generate",
        headers={},
        inflight=lambda: 5,
        completions=lambda: 0,
        ready=lambda: True,
    )
    return replace(engine, **watched)


@pytest.mark.parametrize("restarted", [False, True])
def test_an_engine_restarting_while_a_failed_probe_waits_for_the_window_is_not_judged(
    restarted: bool,
) -> None:
    """The probe fails before the window closes (here at once: nothing listens on the port)
    and its answer waits for the close. An engine that died meanwhile and is starting again
    is a new process, not judged until it is ready; one that did not is found stalled at the
    close."""
    incarnation, ready = [0], [True]
    stalls: list[dict[str, Any]] = []
    engine = never_moving(ready=lambda: ready[0], incarnation=lambda: incarnation[0])
    # A young window of 4 s from the first look (0.5 s), looks every 0.5 s: the probe goes,
    # and fails, at about 2 s; its answer waits for the close, at about 4.5 s.
    watchdog = StallWatchdog(engine, 4.0, stalls.append)
    watchdog.start()
    try:
        time.sleep(3.0)
        if restarted:  # died while the answer waits: restarting, not ready
            incarnation[0], ready[0] = 1, False
        deadline = time.monotonic() + 4.0
        while time.monotonic() < deadline and not stalls:
            threading.Event().wait(0.1)
    finally:
        watchdog.stop()
    assert len(stalls) == (0 if restarted else 1), stalls


@pytest.mark.parametrize(
    ("cpu", "now", "window_s", "stopped"),
    [
        ((4.0, 4.0, 4.0), 12.0, 20.0, True),  # none since the look at 10 s, inside a 20-s window
        ((4.0, 4.0, 4.0), 11.9, 20.0, False),  # not yet CPU_STILL_S
        ((4.0, 4.1, 4.2), 13.0, 20.0, False),  # it spins: its CPU time rose at the last look
        ((4.0, None, 4.0), 13.0, 20.0, False),  # unreadable once: its time starts again
        ((None, None, None), 40.0, 20.0, False),  # never readable: the window alone judges
        ((4.0, 4.0, 4.0), 11.0, 1.0, True),  # a window shorter than CPU_STILL_S bounds it
    ],
)
def test_an_engine_still_in_tokens_and_cpu_time_is_stopped(
    cpu: tuple[float | None, ...], now: float, window_s: float, stopped: bool
) -> None:
    """Looks at 10, 11 and 12 s find no token (requests in flight) and these CPU times."""
    clock = StallClock(9.0, (5.0,))
    for at, cpu_s in zip((10.0, 11.0, 12.0), cpu, strict=True):
        clock = advance(clock, at, 3, (5.0,), cpu_s)
    assert cpu_stopped(clock, now, window_s) is stopped


def test_a_stopped_process_is_found_by_its_cpu_time_a_spinning_one_is_not() -> None:
    """A real process group as the engine, requests in flight, no token ever: spinning, it
    is not judged inside its 30-s window; stopped (SIGSTOP), it is found about CPU_STILL_S
    later, by its CPU time, with no probe waited out."""
    spinner = subprocess.Popen([sys.executable, "-c", "while True: pass"], start_new_session=True)
    stalls: list[dict[str, Any]] = []
    engine = never_moving(cpu_s=lambda: group_cpu_s(spinner.pid))
    watchdog = StallWatchdog(engine, 30.0, stalls.append, interval_s=0.25)
    try:
        watchdog.start()
        time.sleep(3.0)
        assert stalls == []  # spinning: its CPU time rises
        os.kill(spinner.pid, signal.SIGSTOP)
        stopped_at = time.monotonic()
        while not stalls and time.monotonic() - stopped_at < 10:
            threading.Event().wait(0.05)
        found_s = time.monotonic() - stopped_at
    finally:
        watchdog.stop()
        spinner.kill()
        spinner.wait()
    assert len(stalls) == 1, stalls
    assert stalls[0]["health"].startswith("no CPU time"), stalls
    assert stalls[0]["stall_window_s"] == 30.0
    assert CPU_STILL_S - 0.3 <= found_s < CPU_STILL_S + 1.5, (found_s, stalls)
