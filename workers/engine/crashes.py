"""How an engine died, read from its log: the last error line, known crash signatures, and
whether it keeps dying the same way (a crash loop) or at random (flaky).

An engine that dies with the same last error on every restart is broken in a way a restart
cannot fix (SGLang 0.5.15 crashing once the running batch reaches its largest CUDA graph); one
that dies differently each time is flaky (a node, a driver, a bad prompt). The first wants its
workaround named, the second a restart. Everything here is pure: log lines in, verdicts out.

    last_error_line(["[2026-01-01 10:00:00 TP0] Scheduler hit an exception: Traceback ...",
                     "RuntimeError: The expanded size of the tensor (33554432) must match ...",
                     "[2026-01-01 10:00:01] Received sigquit from a child process."])
    # 'RuntimeError: The expanded size of the tensor (33554432) must match ...'
"""

from __future__ import annotations

import re
import signal
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

# Times in a row the same last error makes a crash loop rather than bad luck.
CRASH_LOOP_REPEATS = 3

_PREFIX = re.compile(r"^\s*\[[^\]]*\]\s*")  # SGLang's `[2026-01-01 10:00:00 TP0] `
_ERROR = re.compile(r"\b(?:[A-Z]\w*(?:Error|Exception)|Traceback|Fatal|FATAL|panic)\b")


@dataclass(frozen=True, slots=True)
class CrashSignature:
    """A crash of the engine itself, known by the line it dies with, and how to avoid it."""

    name: str
    pattern: re.Pattern[str]
    what: str
    workaround: str


KNOWN_CRASHES: tuple[CrashSignature, ...] = (
    CrashSignature(
        name="sglang_cuda_graph_verify_buffers",
        # sglang 0.5.15, hybrid model + triton attention + EAGLE + CUDA graphs, raised in
        # `_update_target_verify_buffers` once the running batch reaches the largest captured
        # CUDA graph size (the sizes differ by 4096 elements).
        pattern=re.compile(
            r"RuntimeError: The expanded size of the tensor \(\d+\) must match the existing "
            r"size \(\d+\)"
        ),
        what="SGLang crashes once the running batch reaches its largest captured CUDA graph "
        "(EAGLE verify buffers, hybrid model)",
        workaround="--disable-cuda-graph avoids it (--engine-extra-args --disable-cuda-graph; "
        "genfleet's argv adds it on that configuration unless a --cuda-graph-* flag is "
        "given), or, untested, keep the running batch below the largest captured graph "
        "(--cuda-graph-max-bs above --max-running-requests)",
    ),
)


def last_error_line(lines: Iterable[str]) -> str | None:
    """The last line of an engine's log that names an error, without its log prefix."""
    found = None
    for line in lines:
        text = _PREFIX.sub("", line).strip()
        if text and _ERROR.search(text) and not text.startswith("Traceback"):
            found = text
    return found[:500] if found else None


# Signals a process is sent by others: a kill, a termination, an interrupt, a hang-up. An exit
# by one of them with no error line in the log is a kill from outside (an operator, the OOM
# killer, a node's shutdown); a fault the process raises on itself (SIGSEGV, SIGABRT, SIGBUS,
# SIGFPE, SIGILL, …) is its own.
OUTSIDE_SIGNALS = frozenset(
    {signal.SIGKILL, signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT}
)


def is_crash(line: str | None, killed: bool, returncode: int | None) -> bool:
    """Whether an exit is the engine's own, the kind a prompt in flight can cause: the
    watchdog did not kill it, and either the process's log names an error or the process
    ended itself: an exit code (0 included: nobody outside makes a process exit 0), or a
    fault signal it raised on itself. An exit by a signal others send (SIGKILL, the OOM
    killer; SIGTERM) with no error line is a kill from outside. An error line decides alone:
    SGLang's launcher SIGKILLs its own process tree when its scheduler dies.

    >>> is_crash("RuntimeError: boom", False, -9), is_crash(None, False, -9)
    (True, False)
    >>> is_crash(None, False, 1), is_crash(None, False, 0), is_crash(None, False, -11)
    (True, True, True)
    >>> is_crash("RuntimeError: boom", True, 1)
    False
    """
    if killed:
        return False
    if line is not None:
        return True
    if returncode is None:
        return False
    return returncode >= 0 or -returncode not in OUTSIDE_SIGNALS


def known_crash(line: str | None) -> CrashSignature | None:
    """The known engine crash a last error line is, if any."""
    if not line:
        return None
    return next((sig for sig in KNOWN_CRASHES if sig.pattern.search(line)), None)


def crash_report(lines: Sequence[str | None], repeats: int = CRASH_LOOP_REPEATS) -> dict[str, Any]:
    """What the engine's recent deaths say, oldest first (each its last error line, or None):

    `loop` when the last `repeats` deaths ended on the same error line (a crash loop: a
    restart will not fix it), `flaky` when the last two differ (a node, a driver, a prompt:
    a restart may), `error` the latest line, `repeats` how many deaths in a row ended on it,
    `known`/`what`/`workaround` when it is a known engine crash.
    """
    latest = lines[-1] if lines else None
    same = 0
    for line in reversed(lines):
        if latest is None or line != latest:
            break
        same += 1
    signature = known_crash(latest)
    return {
        "error": latest,
        "repeats": same,
        "loop": latest is not None and same >= repeats,
        "flaky": len(lines) >= 2 and lines[-1] != lines[-2],
        "known": signature.name if signature else None,
        "what": signature.what if signature else None,
        "workaround": signature.workaround if signature else None,
    }


def crash_suggestion(crash: dict[str, Any]) -> str:
    """What to do about a crash report: the known workaround, or where to look."""
    if crash.get("workaround"):
        return f"{crash['what']}: {crash['workaround']}"
    if crash.get("loop"):
        return (
            f"the engine dies the same way on every restart ({crash['repeats']} times): a "
            "restart will not fix it; read the engine log for the cause"
        )
    if crash.get("flaky"):
        return "flaky: a different error on each of its last deaths (a node, a driver, a prompt)"
    return "the engine died: read its log; a different error each time is a flaky node"


def restart_allowed(restarts: Iterable[float], now: float, budget: int, window_s: float) -> bool:
    """Whether one more restart fits the budget: fewer than `budget` restarts in the last
    `window_s` seconds (times on one monotonic clock). A rate, not a lifetime count: five
    unrelated crashes over two weeks never retire a worker."""
    recent = sum(1 for ts in restarts if now - ts < window_s)
    return recent < budget


def served_its_start(
    spawned_at: float | None, ready_at: float | None, died_at: float, floor_s: float
) -> bool:
    """Whether an engine that died at `died_at` served at least as long as it took to start
    (from `spawned_at` to `ready_at`, None: it never served), and at least `floor_s`: then its
    death ends any crash loop, and the next restart waits the first delay, not a doubled one.
    A loop spends its time starting; an engine that served its start's length did not.

    >>> served_its_start(0.0, 180.0, 400.0, 2.0), served_its_start(0.0, 180.0, 300.0, 2.0)
    (True, False)
    >>> served_its_start(0.0, 0.5, 1.5, 2.0), served_its_start(0.0, None, 900.0, 2.0)
    (False, False)
    """
    if spawned_at is None or ready_at is None:
        return False
    return died_at - ready_at >= max(ready_at - spawned_at, floor_s)


def loop_suggestion(crash: dict[str, Any]) -> str:
    """What a crash loop's finding says (`crash`: a `crash_report`)."""
    return (
        f"crash loop, the same error {crash['repeats']} times: {crash['error']} — "
        f"{crash_suggestion(crash)}"
    )


def budget_suggestion(alarm: dict[str, Any]) -> str:
    """What a spent restart budget's finding says (`alarm`: the runtime's engine alarm: the
    supervisor's budget figures, its crash report, its last error)."""
    crash = alarm["crash"] or {}
    return (
        f"restart budget spent ({alarm['restarts_in_window']} restarts in "
        f"{alarm['restart_window_s']:.0f} s); last error: "
        f"{crash.get('error') or alarm['last_error']} — {crash_suggestion(crash)}; "
        f"the worker takes work again in {alarm['cooldown_left_s'] or 0:.0f} s"
    )
