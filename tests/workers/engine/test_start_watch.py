"""Whether a starting engine moves (workers/engine/start_watch.py): a process group's CPU
time read from /proc on real processes, and the judgement over looks."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from genfleet.workers.engine.start_watch import StartProgress, group_cpu_s
from harness.waits import wait_for

BUSY = "import os\nif os.fork() == 0:\n    while True: pass\nwhile True: pass\n"


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="no /proc")
def test_a_groups_cpu_time_grows_while_it_runs_and_stands_while_it_is_stopped() -> None:
    """Two busy processes in one group (the engine and a child, as SGLang's scheduler is)."""
    proc = subprocess.Popen([sys.executable, "-c", BUSY], start_new_session=True)
    try:
        first = group_cpu_s(proc.pid)
        assert first is not None
        wait_for(lambda: (group_cpu_s(proc.pid) or 0) > first + 0.5, 10, "CPU time used", 0.1)
        os.killpg(proc.pid, signal.SIGSTOP)
        time.sleep(0.2)
        stopped = group_cpu_s(proc.pid)
        time.sleep(1.0)
        assert group_cpu_s(proc.pid) == stopped
        assert group_cpu_s(proc.pid + 10_000_000) is None  # no such group
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


def test_a_process_whose_name_holds_parentheses_and_spaces_is_read(tmp_path: Path) -> None:
    proc_root = tmp_path / "proc"
    for pid, name, pgrp, utime, stime in ((7, "a) (b c", 7, 150, 50), (8, "x", 9, 1000, 0)):
        (proc_root / str(pid)).mkdir(parents=True)
        rest = f"S 1 {pgrp} {pgrp} 0 -1 0 0 0 0 0 {utime} {stime} 0 0 20 0 1 0"
        (proc_root / str(pid) / "stat").write_text(f"{pid} ({name}) {rest}\n")
    (proc_root / "self").mkdir()
    assert group_cpu_s(7, proc_root) == pytest.approx(200 / os.sysconf("SC_CLK_TCK"))
    assert group_cpu_s(8, proc_root) is None


@pytest.mark.parametrize(
    ("looks", "frozen"),
    [
        ([(1, 0.5, 1), (5, 0.5, 1), (10.5, 0.5, 1)], [False, False, False]),  # 9.5 s still
        ([(1, 0.5, 1), (5, 0.5, 1), (11.5, 0.5, 1)], [False, False, True]),
        ([(1, 0.5, 1), (8, 0.5, 2), (15, 0.5, 2)], [False, False, False]),  # a line: it moved
        ([(1, 0.5, 1), (8, 0.6, 1), (15, 0.6, 1)], [False, False, False]),  # CPU: it moved
        ([(1, None, 1), (20, None, 1), (40, None, 1)], [False, False, False]),  # no /proc
    ],
)
def test_a_start_is_frozen_once_nothing_moved_for_the_window(
    looks: list[tuple[float, float | None, int]], frozen: list[bool]
) -> None:
    progress = StartProgress(window_s=10, since_s=0)
    assert [progress.look(*look) for look in looks] == frozen
