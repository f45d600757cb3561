"""A test's worker processes (`python -m genfleet.workers worker`, with the emulator, started
through the same supervisor code path as SGLang) and the processes around them, found in /proc:
their engines, their children, what is left of a run."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

from harness.control import answering
from harness.env import ROOT
from harness.waits import wait_for


class Worker:
    """A real `python -m genfleet.workers worker` process (with its emulator engine)."""

    def __init__(
        self,
        env: dict[str, str],
        log: Path,
        hostname: str,
        args: list[str],
        prefix: Sequence[str] = (),
        broker_url: str | None = None,
    ) -> None:
        """`prefix` runs it through another command that execs it (`ip netns exec NODE`: a
        worker of another node, harness/nodes.py); `broker_url` is where this process asks
        whether it is ready, when the worker's own Redis URL is not reachable from here."""
        self.hostname = hostname
        self.log = log
        self.broker_url = broker_url or env["GENFLEET_REDIS_URL"]
        self.proc = subprocess.Popen(
            [*prefix, sys.executable, "-m", "genfleet.workers", *args, "--hostname", hostname],
            env=env,
            cwd=ROOT,
            stdout=log.open("ab"),
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )

    def wait_ready(self, timeout_s: float = 60.0) -> None:
        def ready() -> bool:
            if self.proc.poll() is not None:
                raise AssertionError(f"worker exited {self.proc.returncode}:\n{self.tail()}")
            return self.hostname in answering(self.broker_url, [self.hostname])

        wait_for(ready, timeout_s, f"worker {self.hostname} to be ready", 0.2)

    def tail(self, lines: int = 40) -> str:
        return "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:])

    def kill(self, sig: int = signal.SIGKILL) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.kill(self.proc.pid, sig)

    def stop(self, timeout_s: float = 30.0) -> None:
        if self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.proc.pid, signal.SIGKILL)  # whatever is left of the worker's group


def processes_with_env(needle: str) -> list[int]:
    """Pids of live processes whose environment holds `needle` (this test's store URL)."""
    found = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            if needle.encode() in (proc / "environ").read_bytes():
                found.append(int(proc.name))
        except OSError:
            continue
    return found


def pid_alive(pid: int) -> bool:
    """True while `pid` exists and is not a zombie."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def child_pids(pid: int) -> list[int]:
    """Direct children of `pid`, by parent pid in /proc/*/stat (no /proc children files here)."""
    found: list[int] = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        with contextlib.suppress(OSError, IndexError, ValueError):
            fields = stat.read_text().rsplit(")", 1)[1].split()
            if int(fields[1]) == pid:
                found.append(int(stat.parent.name))
    return sorted(found)


def cmdline(pid: int) -> list[bytes]:
    """The argv of process `pid`, [] once it is gone."""
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")[:-1]
    except OSError:
        return []


def live_children(pid: int, needle: bytes) -> list[int]:
    """Live children of `pid` whose command line holds `needle` (an engine: `sglang`, ...)."""
    return [c for c in child_pids(pid) if needle in b" ".join(cmdline(c)) and pid_alive(c)]


def engine_pid(worker: Worker) -> int | None:
    """The pid of the worker's emulator engine, or None while it has none."""
    found = live_children(worker.proc.pid, b"genfleet.workers.engine.emulator")
    return found[0] if found else None


def log_count(worker: Worker, text: str) -> int:
    return worker.log.read_text(errors="replace").count(text)
