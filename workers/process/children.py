"""The worker processes of one node: one per GPU group (`worker --gpus 0,1,2,3 --tp-size 2`),
each restarted when it dies unasked, within a budget; a signal to the parent reaches every child.
"""

from __future__ import annotations

import logging
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from genfleet.common.backoff import Backoff

log = logging.getLogger("genfleet.worker")


def restart_delay_s(
    code: int, restarts: int, budget: int, stopping: bool, backoff_s: float
) -> float | None:
    """Seconds to wait before restarting a child worker that exited with `code`, or None to
    let it go: a stop was asked for, it exited cleanly (0), or its budget is spent.

    >>> restart_delay_s(-9, 0, 5, False, 2.0), restart_delay_s(-9, 5, 5, False, 2.0)
    (2.0, None)
    """
    if stopping or code == 0 or restarts >= budget:
        return None
    return Backoff(base_s=backoff_s).delay_s(restarts)


@dataclass
class Child:
    argv: list[str]
    env: dict[str, str]
    label: str
    proc: subprocess.Popen[bytes] | None = None
    restarts: int = 0
    due_at: float | None = None  # when a restart is due
    code: int | None = None  # the final exit code, once it is let go
    last_code: int = 0  # how it last exited


class ChildWorkers:
    """Start every child, watch them, restart the ones that die unasked; `run()` returns the
    highest final exit code once every child is let go. `report` is told of each restart."""

    def __init__(
        self,
        children: list[Child],
        budget: int,
        backoff_s: float,
        report: Callable[[Child, int], None] | None = None,
        poll_s: float = 0.5,
    ) -> None:
        self.children = children
        self.budget = budget
        self.backoff_s = backoff_s
        self.report = report
        self.poll_s = poll_s
        self.stopping = False

    def signal(self, signum: int) -> None:
        """Forward a signal to every live child; a stop is not a death to restart."""
        self.stopping = True
        for child in self.children:
            if child.proc is not None and child.proc.poll() is None:
                child.proc.send_signal(signum)

    def _start(self, child: Child) -> None:
        child.proc = subprocess.Popen(child.argv, env=child.env)
        child.due_at = None

    def _check(self, child: Child, now: float) -> None:
        if child.code is not None:
            return
        if child.due_at is not None:
            if self.stopping:
                child.code = child.last_code
            elif now >= child.due_at:
                self._start(child)
            return
        assert child.proc is not None
        code = child.proc.poll()
        if code is None:
            return
        delay = restart_delay_s(code, child.restarts, self.budget, self.stopping, self.backoff_s)
        if delay is None:
            if code and not self.stopping:
                log.error("%s exited with code %d; restart budget spent", child.label, code)
            child.code = code
            return
        child.restarts += 1
        child.last_code = code
        log.error(
            "%s exited with code %d: restarting it in %.1f s (%d of %d)",
            child.label,
            code,
            delay,
            child.restarts,
            self.budget,
        )
        if self.report is not None:
            self.report(child, code)
        child.due_at = now + delay

    def run(self) -> int:
        for child in self.children:
            self._start(child)
        while any(child.code is None for child in self.children):
            for child in self.children:
                self._check(child, time.monotonic())
            time.sleep(self.poll_s)
        return max(child.code or 0 for child in self.children)


def report_restart(settings: Any, child: Child, code: int) -> None:
    """A `worker_restarted` finding in the findings stream (and `genfleet findings`)."""
    import redis

    from genfleet.common import findings
    from genfleet.common.redis_conn import connect

    finding = {
        "worker": child.label,
        "gpu_uuid": None,
        "verdict": "unresponsive",
        "cause": "worker_restarted",
        "numbers": {"exit_code": code, "restarts": child.restarts},
        "suggestion": "a child worker died and was restarted: read its log for the cause",
        "ts": time.time(),
        "run": None,
    }
    try:
        client = connect(settings, check=False, timeout_s=5.0)
        findings.record(client, finding, settings.findings_maxlen)
        client.close()
    except redis.RedisError as exc:
        log.warning("could not record the restart of %s: %s", child.label, exc)
