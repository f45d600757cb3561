"""Supervising one engine process: spawn, readiness, restart within a budget, clean stop.

The lifecycle is the same for SGLang, the emulator and a user's command (they differ only in
their EngineLaunch). The engine runs in its own process group bound to 127.0.0.1, with
`CUDA_VISIBLE_DEVICES` set to the worker's GPUs; its output goes to a log file and a ring
buffer whose tail is quoted when it fails to start. Readiness follows SGLang: connection
refused while loading, 503 until warm-up ends, then 200.

If the engine dies while serving, requests in flight fail fast (connection errors), the
supervisor restarts it with exponential backoff, and callers block in `wait_up()` until it is
back. The restart budget is a rate: `restart_budget` restarts per `restart_window_s`. When it
is spent the supervisor turns `exhausted` and calls `on_exhausted` so the worker stops taking
work; after `restart_cooldown_s` it starts the engine again and, once it serves, calls
`on_recovered` so the worker consumes again, rather than idle its GPU for the rest of a run.
Each death's last error line is kept (`crash`, see `crashes`): the same one on consecutive
deaths is a crash loop, named with its workaround when it is a known engine crash. An engine
that is alive but stalled (see `watchdog`) is killed with `kill_stalled()` and then restarted
the same way; one frozen while it starts (see `start_watch`) is killed and started again.
"""

from __future__ import annotations

import collections
import contextlib
import logging
import os
import signal
import subprocess
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, Literal

import httpx
import orjson

from genfleet.common.backoff import Backoff
from genfleet.common.errors import EngineDown, EngineStartError, RestartBudgetExhausted
from genfleet.common.private import die_with_parent as _die_with_parent
from genfleet.workers.engine.crashes import (
    crash_report,
    is_crash,
    known_crash,
    last_error_line,
    restart_allowed,
    served_its_start,
)
from genfleet.workers.engine.launch import EngineLaunch, auth_headers, engine_env
from genfleet.workers.engine.ports import open_private, private_dir, release_port
from genfleet.workers.engine.start_watch import StartProgress, group_cpu_s

# The longest wait between two readiness polls of a starting engine (they begin at 50 ms).
READY_POLL_MAX_S = 0.25

log = logging.getLogger("genfleet.engine")

State = Literal["stopped", "starting", "ready", "restarting", "exhausted"]


class EngineSupervisor:
    """One engine for one worker. Thread-safe; `start()` blocks until ready or failed."""

    def __init__(
        self,
        launch: EngineLaunch,
        *,
        gpus: str | None = None,
        log_path: Path | None = None,
        startup_timeout_s: float = 3600.0,
        stop_timeout_s: float = 30.0,
        restart_budget: int = 5,
        restart_backoff_s: float = 2.0,
        on_exhausted: Callable[[str], None] | None = None,
        restart_window_s: float = 3600.0,
        restart_cooldown_s: float = 600.0,
        on_recovered: Callable[[], None] | None = None,
        on_death: Callable[[], None] | None = None,
        start_stall_s: float = 0.0,
        on_restarted: Callable[[], None] | None = None,
    ) -> None:
        """`start_stall_s`: a starting engine that used no CPU time and wrote no log line for
        this long is frozen, killed and started again (`start_watch`; 0: only
        `startup_timeout_s` ends a start)."""
        self.launch = launch
        self.gpus = gpus
        self.log_path = log_path
        self.startup_timeout_s = startup_timeout_s
        self.start_stall_s = start_stall_s
        self.log_lines = 0  # lines the engine wrote, all of its processes together
        self.stop_timeout_s = stop_timeout_s
        self.restart_budget = restart_budget
        self.restart_backoff_s = restart_backoff_s
        self.on_exhausted = on_exhausted
        self.restart_window_s = restart_window_s
        self.restart_cooldown_s = restart_cooldown_s
        self.on_recovered = on_recovered
        self.on_death = on_death  # after each death is recorded (crash, deaths): publish it
        self.on_restarted = on_restarted  # after each restart, once the engine serves
        self.state: State = "stopped"
        self.restarts = 0  # since the worker started (a figure; the budget is a rate)
        # Restarts since the last engine that served as long as it took to start: the restart
        # delay doubles with these (a crash loop), not with every restart in the window.
        self._loop_restarts = 0
        self.restart_delay_s = 0.0  # what the last restart waited before it spawned
        self._spawned_at: float | None = None  # when the running engine's process started
        self._ready_at: float | None = None  # when it first served (None: not yet)
        self.last_start_s: float | None = None  # spawn to serving, of the last start that served
        # What told the last start it serves: its ready line, or its health path's 200.
        self.ready_by: Literal["line", "health"] | None = None
        self.exits = 0  # unexpected exits, stalls killed included
        # Exits no known engine crash explains: a prompt in flight may have caused them (the
        # feeder counts them per prompt; see feeding.suspects).
        self.deaths = 0
        # Of those, the exits the engine made itself (`crashes.is_crash`: an error line, an exit
        # code, a fault signal; not a kill: neither the watchdog's nor a signal from outside):
        # what a prompt's crash looks like, and the only deaths a prompt is ever blamed for
        # (the feeder's error record `engine_crash`).
        self.crashes = 0
        self.crash_lines: collections.deque[str | None] = collections.deque(maxlen=20)
        self.cooldown_until: float | None = None  # monotonic; while exhausted
        self._last_death_s: float | None = None
        self._restart_times: collections.deque[float] = collections.deque(maxlen=1000)
        self.server_info: dict[str, Any] = {}
        self.last_error: str | None = None
        self.log_tail: collections.deque[str] = collections.deque(maxlen=200)
        self._proc: subprocess.Popen[bytes] | None = None
        self._lock = threading.RLock()
        self._changed = threading.Condition(self._lock)
        self._stopping = threading.Event()
        self._monitor: threading.Thread | None = None
        self._pump: threading.Thread | None = None
        # Set by the log pump when the running process logs `launch.ready_line`.
        self._fired_up = threading.Event()
        self._log_file: Any = None
        self._kill_reason: str | None = None
        self._config_path: Path | None = None

    # --- public ---------------------------------------------------------------------------

    @property
    def base_url(self) -> str:
        return self.launch.base_url

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc else None

    def alive(self) -> bool:
        """Whether the engine process runs now (a dead one's exit may not be seen yet)."""
        proc = self._proc
        return proc is not None and proc.poll() is None

    def start(self) -> dict[str, Any]:
        """Spawn the engine and wait until it serves; returns its /server_info (or {})."""
        with self._lock:
            if self.state == "ready":
                return self.server_info
            self._stopping.clear()
            self._set_state("starting")
        self._spawn()
        self._wait_ready()
        self._monitor = threading.Thread(target=self._watch, name="engine-monitor", daemon=True)
        self._monitor.start()
        return self.server_info

    def wait_up(self, timeout_s: float) -> None:
        """Block until the engine is ready again; raise when it cannot be (budget, stop)."""
        deadline = time.monotonic() + timeout_s
        with self._changed:
            while self.state != "ready":
                if self.state == "exhausted":
                    raise RestartBudgetExhausted(self.last_error or "engine restart budget spent")
                if self._stopping.is_set():
                    raise EngineDown("engine is stopping")
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise EngineDown(f"engine not back within {timeout_s:.0f} s ({self.state})")
                self._changed.wait(min(remaining, 1.0))

    @property
    def crash(self) -> dict[str, Any] | None:
        """What the recent deaths say (`crashes.crash_report`): None before the first, and
        once the last is older than the restart window (an engine serving for that long is
        no longer in a crash loop)."""
        last = self._last_death_s
        if not self.crash_lines or last is None:
            return None
        if time.monotonic() - last >= self.restart_window_s:
            return None
        return crash_report(list(self.crash_lines))

    def budget(self, now: float | None = None) -> dict[str, Any]:
        """The restart budget now: restarts in the window, the rate, the cool-down left."""
        now = time.monotonic() if now is None else now
        recent = sum(1 for ts in self._restart_times if now - ts < self.restart_window_s)
        until = self.cooldown_until
        return {
            "restarts_in_window": recent,
            "restart_budget": self.restart_budget,
            "restart_window_s": self.restart_window_s,
            "cooldown_left_s": round(max(until - now, 0.0), 1) if until is not None else None,
        }

    def forgive(self, restarts: int) -> None:
        """A prompt was blamed for deaths (`feeding.blame`: it killed the engine as it
        arrived, and the engine serves other prompts): the latest `restarts` restarts in the
        window no longer count against the budget. One bad prompt costs its record, never its
        worker's budget, however many bad prompts a window holds. A budget already spent
        stays spent (its cool-down runs)."""
        with self._lock:
            for _ in range(min(restarts, len(self._restart_times))):
                self._restart_times.pop()

    def refresh_info(self) -> dict[str, Any]:
        """Read /server_info again (accept length changes as the engine generates)."""
        info = self._get_server_info()
        if info:
            self.server_info = info
        return self.server_info

    def kill_stalled(self, reason: str) -> bool:
        """SIGKILL the engine's whole process group (it works on a stopped process too); the
        monitor sees the exit and restarts it within the restart budget. False when there was
        no running engine to kill."""
        with self._lock:
            proc = self._proc
            if proc is None or proc.poll() is not None or self.state != "ready":
                return False
            self._kill_reason = reason
        log.error("engine (pid %s) is stalled: %s; killing its process group", proc.pid, reason)
        self._reap_group(proc.pid)
        return True

    def stop(self) -> None:
        """SIGTERM the engine's process group, then SIGKILL after stop_timeout_s. Idempotent."""
        self._stopping.set()
        with self._changed:
            proc = self._proc
            self._set_state("stopped")
        if proc is not None:
            self._terminate(proc)
        if self._monitor and self._monitor is not threading.current_thread():
            self._monitor.join(timeout=self.stop_timeout_s + 5)
        if self._pump:
            self._pump.join(timeout=5)
        if self._log_file:
            with contextlib.suppress(OSError):
                self._log_file.close()
            self._log_file = None
        if self._config_path is not None:
            self._config_path.unlink(missing_ok=True)
        release_port(self.launch.port)

    # --- spawning and readiness -----------------------------------------------------------

    def _set_state(self, state: State) -> None:
        with self._changed:
            self.state = state
            self._changed.notify_all()

    def _spawn(self) -> None:
        # An explicit environment: the engine (or a user's command) never sees the worker's
        # Redis URL, AWS keys or Flower credentials.
        env = engine_env(os.environ, self.launch.env, self.gpus)
        argv = list(self.launch.argv)
        if self.launch.config:
            argv += ["--config", str(self._write_config())]
        if self.log_path and self._log_file is None:
            self._log_file = open_log(self.log_path)
        log.info("starting engine: %s", self.launch.describe())
        self._spawned_at, self._ready_at = time.monotonic(), None
        try:
            proc = subprocess.Popen(
                argv,
                env=env,
                stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                start_new_session=True,  # its own process group: stop() kills the whole tree
                preexec_fn=_die_with_parent,
            )
        except OSError as exc:
            raise EngineStartError(f"cannot run {self.launch.argv[0]!r}: {exc}") from exc
        self._proc = proc
        self.log_tail.clear()  # this process's lines: its last error is its own
        self._fired_up = threading.Event()  # this process's: a dead one's line says nothing
        self._pump = threading.Thread(
            target=self._pump_logs, args=(proc, self._fired_up), name="engine-log", daemon=True
        )
        self._pump.start()

    def _write_config(self) -> Path:
        """The engine's `--config` file (its API key): 0600 in a 0700 directory of this
        user's, never through a symlink; removed when the engine stops."""
        path = private_dir("engines") / f"engine-{self.launch.port}.yaml"
        fd = open_private(path, os.O_WRONLY | os.O_TRUNC)
        with os.fdopen(fd, "wb") as handle:
            handle.write(orjson.dumps(self.launch.config))
        self._config_path = path
        return path

    def _pump_logs(self, proc: subprocess.Popen[bytes], fired_up: threading.Event) -> None:
        assert proc.stdout is not None
        # SGLang logs its server_args at start, the API key among them: never kept as is.
        secret = self.launch.api_key.encode() if self.launch.api_key else None
        ready_line = self.launch.ready_line
        for raw in proc.stdout:
            if secret is not None:
                raw = raw.replace(secret, b"***")
            line = raw.decode("utf-8", "replace").rstrip()
            # Only while it starts: once it serves, a logged request could hold the words.
            if ready_line and not fired_up.is_set() and line.endswith(ready_line):
                fired_up.set()
            self.log_tail.append(line)
            self.log_lines += 1
            if self._log_file:
                with contextlib.suppress(OSError, ValueError):
                    self._log_file.write(raw)

    def _wait_ready(self) -> None:
        """Until the engine logs its ready line (`EngineLaunch.ready_line`) or answers 200 on
        its health path, whichever comes first; a stop, an exit, a start frozen or the
        startup timeout end the wait with an error."""
        url = self.launch.base_url + self.launch.health_path
        fired_up = self._fired_up
        headers = self._headers()
        deadline = time.monotonic() + self.startup_timeout_s
        delay = 0.05
        progress = StartProgress(self.start_stall_s, time.monotonic())
        looked = 0.0
        timeout = httpx.Timeout(poll_timeout_s(self.start_stall_s), connect=2.0)
        with httpx.Client(timeout=timeout) as client:
            while True:
                proc = self._proc
                if self._stopping.is_set():
                    raise EngineDown("engine start interrupted by stop")
                if proc is None or proc.poll() is not None:
                    code = proc.returncode if proc else None
                    time.sleep(0.1)  # let the log pump drain the last lines
                    raise EngineStartError(
                        f"engine exited with code {code} before it was ready",
                        list(self.log_tail),
                    )
                if fired_up.is_set():
                    break
                with contextlib.suppress(httpx.TransportError):
                    if client.get(url, headers=headers).status_code == 200:
                        break
                if time.monotonic() > deadline:
                    self._terminate(proc)
                    raise EngineStartError(
                        f"engine not ready after {self.startup_timeout_s:.0f} s "
                        f"(raise --startup-timeout-s for big models)",
                        list(self.log_tail),
                    )
                now = time.monotonic()
                if self.start_stall_s and now - looked >= 1.0:  # /proc read once a second
                    looked = now
                    if progress.look(now, group_cpu_s(proc.pid), self.log_lines):
                        # SIGKILL at once: a stopped process never acts on a SIGTERM.
                        self._reap_group(proc.pid)
                        with contextlib.suppress(subprocess.TimeoutExpired):
                            proc.wait(timeout=5)
                        raise EngineStartError(
                            f"engine frozen while starting: no CPU time and no log line for "
                            f"{self.start_stall_s:.0f} s (--engine-stall-timeout-s); killed",
                            list(self.log_tail),
                        )
                if fired_up.wait(delay):
                    break
                # At most a quarter second: every engine start (a worker's, each restart) waits
                # for the poll after it is ready; a refused connect or a 503 costs nothing.
                delay = min(delay * 1.5, READY_POLL_MAX_S)
        self._ready_at = time.monotonic()
        self.ready_by = "line" if fired_up.is_set() else "health"
        if self._spawned_at is not None:
            self.last_start_s = self._ready_at - self._spawned_at
        self.server_info = self._get_server_info()
        self._set_state("ready")
        log.info(
            "engine ready at %s (pid %s) %.1f s after its spawn, by its %s: %s",
            self.launch.base_url,
            self.pid,
            self.last_start_s or 0.0,
            "ready line" if self.ready_by == "line" else "health path's 200",
            _info_line(self.server_info),
        )

    def _headers(self) -> dict[str, str]:
        return auth_headers(self.launch.api_key)

    def _get_server_info(self) -> dict[str, Any]:
        if self.launch.kind == "command":
            return {}
        try:
            response = httpx.get(
                self.launch.base_url + "/server_info", headers=self._headers(), timeout=10.0
            )
        except httpx.TransportError:
            return {}
        if response.status_code != 200:
            return {}
        data = response.json()
        return data if isinstance(data, dict) else {}

    # --- watching and restarting ----------------------------------------------------------

    def _watch(self) -> None:
        while not self._stopping.is_set():
            proc = self._proc
            if proc is None:
                return
            try:
                code = proc.wait(timeout=0.5)
            except subprocess.TimeoutExpired:
                continue
            if self._stopping.is_set():
                return
            reason, self._kill_reason = self._kill_reason, None
            self._set_state("restarting")  # callers wait from now on, and see the death counted
            line = self._record_death(proc, killed=reason is not None, returncode=code)
            self.last_error = reason or f"engine exited with code {code}"
            if line and not reason:
                self.last_error += f": {line}"
            log.error("%s; last lines:\n%s", self.last_error, "\n".join(list(self.log_tail)[-20:]))
            if self.on_death:
                self.on_death()
            if not self._restart():
                return

    def _record_death(
        self, proc: subprocess.Popen[bytes], killed: bool, returncode: int | None
    ) -> str | None:
        """Count an unexpected exit and keep its last error line (after the log pump drained
        the process's last lines); `killed`: the watchdog killed it; `returncode`: the exit's
        (negative: the signal that ended it)."""
        if self._pump is not None:
            self._pump.join(timeout=2.0)
        line = last_error_line(self.log_tail)
        with self._lock:
            self.exits += 1
            if known_crash(line) is None:
                self.deaths += 1
                if is_crash(line, killed, returncode):
                    self.crashes += 1
            self.crash_lines.append(line)
            self._last_death_s = time.monotonic()
        return line

    def _restart(self) -> bool:
        """Restart within the budget (a rate); when it is spent, cool down and try again.
        False only when the supervisor is stopping."""
        exhausted = False
        while not self._stopping.is_set():
            now = time.monotonic()
            if not restart_allowed(
                self._restart_times, now, self.restart_budget, self.restart_window_s
            ):
                if not self._cool_down():
                    return False
                exhausted = True
                continue
            self._restart_times.append(now)
            self.restarts += 1
            self._set_state("restarting")
            recent = self.budget(now)["restarts_in_window"]
            if served_its_start(self._spawned_at, self._ready_at, now, self.restart_backoff_s):
                self._loop_restarts = 0
            self._loop_restarts += 1
            self._spawned_at = self._ready_at = None  # judged once: a failed start is no run
            # Doubling with the restarts since an engine last served, and never with more than
            # the window's: a loop's count goes back to the first delay once its restarts leave
            # the window (a cool-down), as the budget does.
            backoff = Backoff(
                base_s=self.restart_backoff_s, cap_s=self.restart_backoff_s * 64
            ).delay_s(min(self._loop_restarts, recent) - 1)
            self.restart_delay_s = backoff
            log.warning(
                "restarting engine (%d of %d in %.0f s) in %.1f s",
                recent,
                self.restart_budget,
                self.restart_window_s,
                backoff,
            )
            if self._stopping.wait(backoff):
                return False
            try:
                self._spawn()
                self._wait_ready()
            except (EngineStartError, EngineDown) as exc:
                if self._stopping.is_set():
                    return False
                self.last_error = str(exc).splitlines()[0]
                if isinstance(exc, EngineStartError):
                    with self._lock:
                        self.crash_lines.append(last_error_line(exc.log_tail))
                        self._last_death_s = time.monotonic()
                log.error("engine restart failed: %s", self.last_error)
                continue
            if exhausted and self.on_recovered:
                log.warning("engine is back after its cool-down: this worker takes work again")
                self.on_recovered()
            if self.on_restarted:
                self.on_restarted()
            return True
        return False

    def _cool_down(self) -> bool:
        """The budget is spent: stop taking work, wait `restart_cooldown_s`, then let the
        caller try again with a fresh window. False when stopped meanwhile."""
        crash = self.crash or {}
        loop = ""
        if crash.get("loop"):
            loop = f"; a crash loop, the same error {crash['repeats']} times"
            if crash.get("workaround"):
                loop += f" ({crash['what']}: {crash['workaround']})"
        again = (
            f"tries again in {self.restart_cooldown_s:.0f} s"
            if self.restart_budget
            else "does not restart it (restart budget 0)"
        )
        message = (
            f"engine restart budget spent ({self.restart_budget} restarts in "
            f"{self.restart_window_s:.0f} s); last error: {self.last_error}{loop}; this worker "
            f"stops taking work and {again}"
        )
        self.last_error = message
        self.cooldown_until = time.monotonic() + self.restart_cooldown_s
        self._set_state("exhausted")
        log.error(message)
        if self.on_exhausted:
            self.on_exhausted(message)
        if self.restart_budget == 0:  # no restart at all, ever (tune, tests): no cool-down
            self.cooldown_until = None
            return False
        if self._stopping.wait(self.restart_cooldown_s):
            return False
        self.cooldown_until = None
        self._restart_times.clear()
        return True

    def _terminate(self, proc: subprocess.Popen[bytes]) -> None:
        if proc.poll() is not None:
            self._reap_group(proc.pid)
            return
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=self.stop_timeout_s)
        except subprocess.TimeoutExpired:
            log.warning("engine ignored SIGTERM for %.0f s: SIGKILL", self.stop_timeout_s)
        self._reap_group(proc.pid)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=5)

    @staticmethod
    def _reap_group(pgid: int) -> None:
        """SIGKILL whatever is left in the engine's group (SGLang's schedulers, say)."""
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(pgid, signal.SIGKILL)


def poll_timeout_s(start_stall_s: float) -> float:
    """How long one readiness poll may wait for its answer while an engine starts: long
    enough for SGLang's /health (a 1-token generation and a 1-s sleep), short enough that the
    start watch, which looks between polls, judges a frozen start near `start_stall_s` (a
    process stopped after it bound its port accepts the connection and never answers: at
    10 s a poll, a start frozen in the chaos bench was killed after 21 s, not 8).

    >>> poll_timeout_s(8.0), poll_timeout_s(300.0), poll_timeout_s(0.0)
    (4.0, 10.0, 10.0)
    """
    if not start_stall_s:
        return 10.0
    return min(10.0, max(3.0, start_stall_s / 2))


def _info_line(info: dict[str, Any]) -> str:
    if not info:
        return "no /server_info"
    return (
        f"speculative_algorithm={info.get('speculative_algorithm')} "
        f"max_running_requests={info.get('max_running_requests')} "
        f"context_length={info.get('context_length')} version={info.get('version')}"
    )


def open_log(path: Path) -> Any:
    """The engine's log, appended to: its directory made 0700 when this creates it, the file
    0600 and never opened through a symlink (a log holds prompts and the engine's settings;
    a predictable path in a shared directory is otherwise an invitation)."""
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    try:
        fd = open_private(path, os.O_WRONLY | os.O_APPEND)
    except OSError as exc:  # ELOOP: a symlink where the log should be
        raise EngineStartError(f"cannot open the engine log {path}: {exc}") from exc
    return os.fdopen(fd, "ab", buffering=0)
