"""The supervisor against real processes: a stdlib HTTP server stands in for a generic engine."""

from __future__ import annotations

import os
import signal
import stat
import subprocess
import sys
import threading
import time
from pathlib import Path

import orjson
import pytest

from genfleet.common.errors import EngineDown, EngineStartError, RestartBudgetExhausted
from genfleet.workers.engine.launch import EngineLaunch
from genfleet.workers.engine.ports import (
    open_private,
    pick_port,
    port_is_free,
    private_dir,
    release_port,
)
from genfleet.workers.engine.sglang_argv import SGLANG_READY_LINE
from genfleet.workers.engine.supervisor import EngineSupervisor
from harness.env import free_port
from harness.waits import wait_for
from tests.fakes.http_engine import engine_argv

pytestmark = pytest.mark.integration


def http_engine(port: int, delay_s: float = 0.0) -> EngineLaunch:
    """An 'engine' that binds after delay_s and answers 200 on /."""
    return EngineLaunch(
        kind="command",
        argv=engine_argv(port, "--delay-s", str(delay_s), "--say", "binding"),
        port=port,
        health_path="/",
    )


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def test_start_stop_in_own_group_with_logs(tmp_path: Path) -> None:
    port = free_port()
    log = tmp_path / "engine.log"
    sup = EngineSupervisor(http_engine(port, 0.3), log_path=log, startup_timeout_s=20)
    sup.start()
    assert (sup.state, sup.ready_by) == ("ready", "health")  # no ready line: its health path
    pid = sup.pid
    assert pid is not None and os.getpgid(pid) == pid != os.getpgid(0)
    assert not port_is_free("127.0.0.1", port)
    wait_for(lambda: "binding" in log.read_text(), 5, "the engine's output in its log")
    assert "binding" in "\n".join(sup.log_tail)
    sup.stop()
    sup.stop()  # idempotent
    assert sup.state == "stopped"
    assert not alive(pid)
    assert port_is_free("127.0.0.1", port)


def test_engine_that_exits_fails_start_with_last_log_lines() -> None:
    launch = EngineLaunch(
        kind="command",
        argv=[
            sys.executable,
            "-c",
            "print('loading weights'); print('CUDA out of memory'); exit(3)",
        ],
        port=free_port(),
    )
    sup = EngineSupervisor(launch, startup_timeout_s=20)
    with pytest.raises(EngineStartError) as info:
        sup.start()
    assert "code 3" in str(info.value)
    assert "CUDA out of memory" in str(info.value)


def test_startup_timeout_kills_and_reports() -> None:
    sup = EngineSupervisor(http_engine(free_port(), 30), startup_timeout_s=1.0, stop_timeout_s=2)
    started = time.monotonic()
    with pytest.raises(EngineStartError, match="not ready after 1 s"):
        sup.start()
    assert time.monotonic() - started < 10
    assert sup.pid is not None and not alive(sup.pid)


def line_engine(port: int, ready_line: str | None, *lines: str) -> EngineLaunch:
    """An 'engine' that prints `lines` and binds, and whose health path never answers 200."""
    says = [word for line in lines for word in ("--say", line)]
    return EngineLaunch(
        kind="command",
        argv=engine_argv(port, *says),
        port=port,
        health_path="/never-200",
        ready_line=ready_line,
    )


def test_an_engine_is_ready_once_it_logs_its_ready_line_without_a_health_poll() -> None:
    """SGLang's /health sleeps a second before its 200: the line it logs as its status turns
    Up is the same news a second sooner, at every start and restart."""
    launch = line_engine(
        free_port(), SGLANG_READY_LINE, "loading", f"[2026-12-07 19:12:39] {SGLANG_READY_LINE}"
    )
    sup = EngineSupervisor(launch, startup_timeout_s=20, stop_timeout_s=5)
    try:
        sup.start()
        assert (sup.state, sup.ready_by) == ("ready", "line")
        assert sup.last_start_s is not None and sup.last_start_s > 0
    finally:
        sup.stop()


@pytest.mark.parametrize(
    ("ready_line", "printed"),
    [
        (None, SGLANG_READY_LINE),  # an engine with no ready line: its health path decides
        (SGLANG_READY_LINE, f"echo: {SGLANG_READY_LINE} (a request's text)"),  # not the line
    ],
)
def test_an_engine_that_does_not_log_its_ready_line_waits_for_its_health(
    ready_line: str | None, printed: str
) -> None:
    sup = EngineSupervisor(
        line_engine(free_port(), ready_line, printed), startup_timeout_s=1.5, stop_timeout_s=5
    )
    with pytest.raises(EngineStartError, match="not ready after"):
        sup.start()


def test_an_engine_frozen_while_it_starts_is_killed_after_the_stall_window_not_the_timeout() -> (
    None
):
    """A SIGSTOP while it loads: no CPU time, no line, no health. Killed once it has not
    moved for the window (here 2 s), long before the 60-s start timeout; restarted within the
    budget, as a dead engine is."""
    port = free_port()
    frozen = EngineLaunch(
        kind="command",
        argv=["sh", "-c", "echo loading; kill -STOP $$"],
        port=port,
        health_path="/",
    )
    sup = EngineSupervisor(frozen, startup_timeout_s=60, stop_timeout_s=30, start_stall_s=2)
    started = time.monotonic()
    with pytest.raises(EngineStartError, match="frozen while starting") as info:
        sup.start()
    assert 2 <= time.monotonic() - started < 10
    assert "loading" in str(info.value)  # its last lines, as any failed start
    assert sup.pid is not None and not alive(sup.pid)


def test_a_start_frozen_after_it_bound_its_port_is_judged_between_short_polls() -> None:
    """Stopped once listening: the kernel accepts each readiness poll's connection and nobody
    answers. Each poll waits its own timeout (here 3 s), not 10 s, so the start watch looks
    often enough to kill it near its window (2 s): at 10 s a poll it took two polls, 20 s."""
    port = free_port()
    bound_then_stopped = (
        "import os, signal, socket\n"
        f"s = socket.socket(); s.bind(('127.0.0.1', {port})); s.listen(16)\n"
        "print('bound', flush=True)\n"
        "os.kill(os.getpid(), signal.SIGSTOP)\n"
    )
    launch = EngineLaunch(
        kind="command",
        argv=[sys.executable, "-c", bound_then_stopped],
        port=port,
        health_path="/",
    )
    sup = EngineSupervisor(launch, startup_timeout_s=60, stop_timeout_s=30, start_stall_s=2)
    started = time.monotonic()
    with pytest.raises(EngineStartError, match="frozen while starting"):
        sup.start()
    assert 2 <= time.monotonic() - started < 8
    assert sup.pid is not None and not alive(sup.pid)


def test_a_start_that_moves_is_not_judged_frozen() -> None:
    """Busy for 4 s without a word, then serving: its CPU time is its progress."""
    port = free_port()
    busy = (
        "import time; t = time.monotonic()\n"
        "while time.monotonic() - t < 4: pass\n"
        f"import runpy, sys; sys.argv = {engine_argv(port)[1:]!r}; "
        "runpy.run_path(sys.argv[0], run_name='__main__')"
    )
    launch = EngineLaunch(
        kind="command", argv=[sys.executable, "-c", busy], port=port, health_path="/"
    )
    sup = EngineSupervisor(launch, startup_timeout_s=30, start_stall_s=1.5)
    sup.start()
    assert sup.state == "ready"
    sup.stop()


def test_crash_restarts_then_budget_exhausted() -> None:
    port = free_port()
    exhausted = threading.Event()
    sup = EngineSupervisor(
        http_engine(port),
        startup_timeout_s=20,
        restart_budget=1,
        restart_backoff_s=0.1,
        on_exhausted=lambda message: exhausted.set(),
    )
    sup.start()
    first = sup.pid
    assert first is not None
    os.killpg(first, signal.SIGKILL)
    wait_for(lambda: sup.pid != first and sup.state == "ready", 20, "a restarted engine")
    assert sup.restarts == 1
    sup.wait_up(1)
    second = sup.pid
    assert second is not None
    # the budget is spent: the next crash leaves it exhausted and callers are told why
    os.killpg(second, signal.SIGKILL)
    assert exhausted.wait(20)
    assert sup.state == "exhausted"
    with pytest.raises(RestartBudgetExhausted, match="budget"):
        sup.wait_up(1)
    sup.stop()


def test_wait_up_while_stopping_raises() -> None:
    sup = EngineSupervisor(http_engine(free_port()), startup_timeout_s=20)
    sup.start()
    sup.stop()
    with pytest.raises(EngineDown):
        sup.wait_up(0.5)


def test_pick_port_reserves_until_released() -> None:
    port = free_port()
    first = pick_port("127.0.0.1", port)
    assert first == port
    # nothing listens yet, but the port is reserved: a second pick moves on (to the next
    # port free on this shared host, usually port + 1)
    second = pick_port("127.0.0.1", port)
    assert second > port
    release_port(second)
    release_port(port)
    assert pick_port("127.0.0.1", port) == port
    release_port(port)
    # another process holding the lock is respected too
    lock = private_dir("ports") / f"{port}.lock"
    code = (
        "import fcntl, time; "
        f"h = open({str(lock)!r}, 'w'); "
        "fcntl.flock(h, fcntl.LOCK_EX); print('locked', flush=True); time.sleep(30)"
    )
    holder = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "locked"
        other = pick_port("127.0.0.1", port)
        assert other != port
        release_port(other)
    finally:
        holder.kill()
        holder.wait()


def test_pick_port_skips_taken_ports() -> None:
    port = free_port()
    sup = EngineSupervisor(http_engine(port), startup_timeout_s=20)
    sup.start()
    try:
        other = pick_port("127.0.0.1", port)
        assert other > port
        release_port(other)
    finally:
        sup.stop()


def test_private_dir_is_0700_and_refuses_links_and_open_modes(tmp_path: Path) -> None:
    made = private_dir("ports", root=tmp_path)
    assert made.is_dir() and stat.S_IMODE(made.stat().st_mode) == 0o700
    assert stat.S_IMODE(made.parent.stat().st_mode) == 0o700
    # a directory someone made world-writable, or a link planted at the name, is refused
    made.chmod(0o777)
    with pytest.raises(EngineStartError, match="open to other users"):
        private_dir("ports", root=tmp_path)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir(mode=0o700)
    (made.parent / "engines").symlink_to(elsewhere)
    with pytest.raises(EngineStartError, match="not a directory of this user's own"):
        private_dir("engines", root=tmp_path)


def test_open_private_does_not_follow_a_symlink(tmp_path: Path) -> None:
    target = tmp_path / "target"
    target.write_text("keep")
    link = tmp_path / "1234.lock"
    link.symlink_to(target)
    with pytest.raises(OSError):
        open_private(link)
    assert target.read_text() == "keep"
    fd = open_private(tmp_path / "fresh.lock")
    os.close(fd)
    assert stat.S_IMODE((tmp_path / "fresh.lock").stat().st_mode) == 0o600


def test_engine_gets_an_explicit_environment_and_its_key_by_config_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The engine process never sees the worker's secrets, and its API key is in a 0600
    `--config` file, not on its argv (which `ps` shows everyone)."""
    monkeypatch.setenv("GENFLEET_REDIS_URL", "redis://:hunter2@redis:6379/0")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "aws-secret")
    monkeypatch.setenv("FLOWER_BASIC_AUTH", "admin:pw")
    monkeypatch.setenv("HF_HOME", "/models/hf")
    port = free_port()
    dump = tmp_path / "seen.json"
    launch = EngineLaunch(
        kind="command",
        argv=engine_argv(port, "--dump", str(dump)),
        env={"SGLANG_X": "1"},
        port=port,
        health_path="/",
        api_key="engine-key",
        config={"api-key": "engine-key"},
    )
    sup = EngineSupervisor(launch, gpus="3", startup_timeout_s=20)
    sup.start()
    try:
        seen = orjson.loads(dump.read_bytes())
        cmdline = Path(f"/proc/{sup.pid}/cmdline").read_bytes()
    finally:
        sup.stop()
    env = seen["env"]
    assert not {"GENFLEET_REDIS_URL", "AWS_SECRET_ACCESS_KEY", "FLOWER_BASIC_AUTH"} & set(env)
    assert (env["HF_HOME"], env["SGLANG_X"], env["CUDA_VISIBLE_DEVICES"]) == (
        "/models/hf",
        "1",
        "3",
    )
    assert b"engine-key" not in cmdline and "engine-key" not in " ".join(seen["argv"])
    assert orjson.loads(seen["config"]) == {"api-key": "engine-key"}
    assert seen["mode"] == 0o600
    config_path = seen["argv"][seen["argv"].index("--config") + 1]
    assert not Path(config_path).exists()  # removed when the engine stopped


def test_engine_log_is_private_and_never_holds_the_api_key(tmp_path: Path) -> None:
    """SGLang logs its server_args, the API key among them, at start: the log genfleet keeps
    (0600, in a directory it makes 0700) and the lines it shows on a failure say `***`."""
    port = free_port()
    launch = EngineLaunch(
        kind="command",
        argv=engine_argv(
            port, "--say", "server_args=ServerArgs(api_key='engine-key', port={port})"
        ),
        port=port,
        health_path="/",
        api_key="engine-key",
    )
    log = tmp_path / "logs" / "engine.log"
    sup = EngineSupervisor(launch, log_path=log, startup_timeout_s=20)
    sup.start()
    try:
        wait_for(lambda: "server_args" in log.read_text(), 5, "the engine's first line")
    finally:
        sup.stop()
    assert "engine-key" not in log.read_text()
    assert "api_key='***'" in log.read_text()
    assert not any("engine-key" in line for line in sup.log_tail)
    assert stat.S_IMODE(os.stat(log).st_mode) == 0o600
    assert stat.S_IMODE(os.stat(log.parent).st_mode) == 0o700


def test_engine_log_is_never_opened_through_a_symlink(tmp_path: Path) -> None:
    target = tmp_path / "someone-elses-file"
    target.write_text("")
    log = tmp_path / "engine.log"
    log.symlink_to(target)
    port = free_port()
    sup = EngineSupervisor(http_engine(port), log_path=log, startup_timeout_s=20)
    with pytest.raises(EngineStartError):
        sup.start()
    sup.stop()
    assert target.read_text() == ""


CRASH_LINE = (
    "RuntimeError: The expanded size of the tensor (33554432) must match the existing size "
    "(33558528) at non-singleton dimension 0"
)


def crashing_engine(port: int, marker: Path) -> EngineLaunch:
    """An engine that serves, and while `marker` exists dies shortly after it starts, its
    last log line CRASH_LINE (as SGLang 0.5.15 does at its largest CUDA graph)."""
    return EngineLaunch(
        kind="command",
        argv=engine_argv(
            port,
            *("--crash-while", str(marker), "--crash-after-s", "0.3"),
            *("--last-words", "Scheduler hit an exception: Traceback (most recent call last):"),
            *("--last-words", CRASH_LINE),
        ),
        port=port,
        health_path="/",
    )


def test_spent_budget_cools_down_then_serves_again_and_names_the_crash_loop(
    tmp_path: Path,
) -> None:
    marker = tmp_path / "crash"
    exhausted: list[str] = []
    recovered = threading.Event()
    sup = EngineSupervisor(
        crashing_engine(free_port(), marker),
        startup_timeout_s=20,
        restart_budget=2,
        restart_window_s=600,
        restart_cooldown_s=1.5,
        restart_backoff_s=0.05,
        on_exhausted=exhausted.append,
        on_recovered=recovered.set,
    )
    try:
        sup.start()
        marker.touch()  # from now on it dies the same way each time it starts
        wait_for(lambda: exhausted, 30, "the restart budget to be spent")
        assert sup.state == "exhausted"
        budget = sup.budget()
        assert budget["restarts_in_window"] == 2 and budget["cooldown_left_s"] is not None
        crash = sup.crash
        assert crash is not None and crash["loop"] and crash["error"] == CRASH_LINE
        assert crash["known"] == "sglang_cuda_graph_verify_buffers"
        assert "--disable-cuda-graph" in exhausted[0] and CRASH_LINE in exhausted[0]
        with pytest.raises(RestartBudgetExhausted):
            sup.wait_up(0.1)
        marker.unlink()  # fixed: after the cool-down it starts and stays up
        assert recovered.wait(30), "the engine never came back after its cool-down"
        sup.wait_up(5)
        assert sup.state == "ready" and sup.budget()["cooldown_left_s"] is None
    finally:
        sup.stop()


def test_restart_budget_counts_over_a_window_not_a_lifetime() -> None:
    exhausted = threading.Event()
    sup = EngineSupervisor(
        http_engine(free_port()),
        startup_timeout_s=20,
        restart_budget=1,
        # wider than a restart takes on a loaded machine (two xdist workers and their engines
        # on two cores), so "the last death is recent" still holds once it serves again
        restart_window_s=2.0,
        restart_backoff_s=0.05,
        on_exhausted=lambda message: exhausted.set(),
    )
    try:
        sup.start()
        for crash in range(1, 4):  # one crash per window, three windows: never spent
            pid = sup.pid
            assert pid is not None
            time.sleep(2.1)  # the last restart leaves the window
            os.killpg(pid, signal.SIGKILL)
            wait_for(lambda p=pid: sup.pid != p and sup.state == "ready", 20, "a restart")
            assert sup.restarts == crash and not exhausted.is_set()
        assert sup.exits == 3 and sup.deaths == 3
        assert sup.crash is not None  # the last death is recent
        # serving for a whole window: no crash to report any more
        wait_for(lambda: sup.crash is None, 10, "the last death to leave the window")
    finally:
        sup.stop()


def test_restarts_forgiven_for_a_blamed_prompt_leave_the_budget() -> None:
    """Two deaths a prompt was blamed for are forgiven: with a budget of two, two more
    deaths are restarted, not a spent budget; and the deaths are still counted."""
    exhausted = threading.Event()
    sup = EngineSupervisor(
        http_engine(free_port()),
        startup_timeout_s=20,
        restart_budget=2,
        restart_window_s=3600,
        restart_backoff_s=0.05,
        on_exhausted=lambda message: exhausted.set(),
    )
    try:
        sup.start()
        for deaths in range(1, 5):
            pid = sup.pid
            assert pid is not None
            os.killpg(pid, signal.SIGKILL)
            wait_for(lambda p=pid: sup.pid != p and sup.state == "ready", 20, "a restart")
            if deaths == 2:
                assert sup.budget()["restarts_in_window"] == 2
                sup.forgive(2)  # the blamed prompt's two deaths
                assert sup.budget()["restarts_in_window"] == 0
        assert not exhausted.is_set()
        assert sup.restarts == 4 and sup.deaths == 4
        sup.forgive(5)  # more than the window holds: it empties, no more
        assert sup.budget()["restarts_in_window"] == 0
    finally:
        sup.stop()


def test_the_restart_delay_doubles_in_a_crash_loop_not_after_an_engine_that_served() -> None:
    """An engine that served at least as long as it took to start was not in a crash loop:
    its restart waits the first delay. Counted over the window instead, a worker whose engine
    died five times in an hour, each after serving for minutes, waited 16 times the first
    delay before its fifth start."""
    sup = EngineSupervisor(
        http_engine(free_port()), startup_timeout_s=20, restart_budget=10, restart_backoff_s=0.2
    )
    sup.start()
    delays = []
    try:
        for served in (True, True, False, False, True):
            pid = sup.pid
            assert pid is not None
            if served:
                time.sleep(3.0)  # longer than the stand-in engine takes to start
            os.killpg(pid, signal.SIGKILL)
            wait_for(
                lambda dead=pid: sup.pid != dead and sup.state == "ready", 20, "a restarted engine"
            )
            delays.append(sup.restart_delay_s)
    finally:
        sup.stop()
    assert delays == [0.2, 0.2, 0.4, 0.8, 0.2]
