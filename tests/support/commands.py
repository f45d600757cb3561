"""The root `genfleet` command in a test: run to its end as a process, invoked in this process,
or left running in the background as a user leaves `genfleet run`."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import redis

from genfleet.common import keys
from harness.env import ROOT, base_env
from harness.processes import processes_with_env
from harness.waits import wait_for

# The root `genfleet` command: its entry point (`genfleet.cli:main`) on this interpreter.
GENFLEET = [sys.executable, "-c", "from genfleet.cli import main; main()"]


def genfleet(
    args: list[str], env: dict[str, str] | None = None, timeout_s: float = 240
) -> subprocess.CompletedProcess[str]:
    """`genfleet ARGS…` run to its end, output captured (in this process's environment
    unless `env` is given)."""
    return subprocess.run(
        [*GENFLEET, *args],
        env=env,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=timeout_s,
        check=False,
    )


def invoke(*args: str, env: dict[str, str] | None = None) -> Any:
    """The root `genfleet` command in this process (typer's CliRunner); returns its Result.

    Its terminal is 400 columns wide: at rich's default 80 a long path (a test's tmp_path
    under xdist) wraps mid-name and no longer reads as one word.
    """
    from typer.testing import CliRunner

    from genfleet.cli import app

    return CliRunner().invoke(app, list(args), env={"COLUMNS": "400", **(env or {})})


class BackgroundRun:
    """`genfleet run SOURCE --batch-size 20` started in the background, as a user leaves it
    running: a slow emulator (time scale 1), its logs and its own TMPDIR (so its run lock)
    under `directory`, its store `directory/store`, stdout and stderr in `directory/run.out`.
    `stop()` kills what is left of it."""

    def __init__(self, redis_url: str, directory: Path, source: Path) -> None:
        self.store = (directory / "store").as_uri()
        self.env = {
            **base_env(redis_url, self.store, emulator_time_scale=1, log_dir=directory / "logs"),
            "TMPDIR": str(directory),
        }
        self.output = directory / "run.out"
        self.proc = subprocess.Popen(
            [*GENFLEET, "run", str(source), "--batch-size", "20"],
            env=self.env,
            cwd=ROOT,
            stdout=self.output.open("wb"),
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )

    def log(self) -> str:
        return self.output.read_text(errors="replace")

    def processes(self) -> list[int]:
        """Every live process of this run (the run, its workers, engines and beat)."""
        return processes_with_env(f"GENFLEET_STORE={self.store}")

    def wait_running(self, client: redis.Redis, timeout_s: float = 90) -> None:
        """Until one of its batches runs; fails with its output if the run ends first."""

        def running() -> bool:
            if self.proc.poll() is not None:
                raise AssertionError(self.log())
            return bool(client.hlen(keys.running_key()))

        wait_for(running, timeout_s, "a batch of the run to be running", 0.2)

    def wait_gone(self, timeout_s: float = 30) -> None:
        wait_for(lambda: not self.processes(), timeout_s, "every process of the run to end", 0.2)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


StartRun = Callable[[str, Path], BackgroundRun]  # the `start_run` fixture
