"""How an engine died, from its log lines: the last error, known crashes, crash loops, and
the restart budget as a rate. Pure functions, table tests."""

from __future__ import annotations

import signal

import pytest

from genfleet.workers.engine.crashes import (
    crash_report,
    crash_suggestion,
    is_crash,
    known_crash,
    last_error_line,
    restart_allowed,
)

CUDA_GRAPH = (
    "RuntimeError: The expanded size of the tensor (33554432) must match the existing size "
    "(33558528) at non-singleton dimension 0.  Target sizes: [33554432].  Tensor sizes: "
    "[33558528]"
)
SGLANG_DEATH = [
    "[2026-11-30 21:04:11 TP0] Decode batch, #running-req: 40, #token: 81920, gen throughput",
    "[2026-11-30 21:04:12 TP0] Scheduler hit an exception: Traceback (most recent call last):",
    '  File "/sglang/srt/speculative/eagle_worker.py", line 512, in _update_target_verify_buffers',
    "    self.buffers[:bs].copy_(x)",
    CUDA_GRAPH,
    "",
    "[2026-11-30 21:04:12] Received sigquit from a child process. It usually means the child "
    "failed.",
]


@pytest.mark.parametrize(
    ("lines", "expected"),
    [
        (SGLANG_DEATH, CUDA_GRAPH),
        (["[2026-01-01 00:00:00] ValueError: bad config", "Killed"], "ValueError: bad config"),
        (["loading weights", "ready", "Killed"], None),
        ([], None),
        (["Traceback (most recent call last):", '  File "x.py"'], None),
        (["CUDA error: an illegal memory access", "torch.OutOfMemoryError: CUDA out of memory"],
         "torch.OutOfMemoryError: CUDA out of memory"),
    ],
)  # fmt: skip
def test_last_error_line(lines: list[str], expected: str | None) -> None:
    assert last_error_line(lines) == expected


def test_the_cuda_graph_crash_is_known_with_its_workaround() -> None:
    signature = known_crash(CUDA_GRAPH)
    assert signature is not None and signature.name == "sglang_cuda_graph_verify_buffers"
    assert "--disable-cuda-graph" in signature.workaround
    assert "--cuda-graph-max-bs" in signature.workaround
    assert known_crash("RuntimeError: CUDA error: an illegal memory access") is None
    assert known_crash(None) is None


@pytest.mark.parametrize(
    ("deaths", "loop", "repeats", "known"),
    [
        ([CUDA_GRAPH, CUDA_GRAPH, CUDA_GRAPH], True, 3, "sglang_cuda_graph_verify_buffers"),
        ([CUDA_GRAPH, CUDA_GRAPH], False, 2, "sglang_cuda_graph_verify_buffers"),
        (["ValueError: a", "ValueError: b", "ValueError: c"], False, 1, None),  # flaky
        (["ValueError: a", "KeyError: x", "KeyError: x", "KeyError: x"], True, 3, None),
        (["KeyError: x", "KeyError: x", None], False, 0, None),  # died without a word
        ([None, None, None], False, 0, None),
    ],
)
def test_crash_loop_is_the_same_error_on_consecutive_deaths(
    deaths: list[str | None], loop: bool, repeats: int, known: str | None
) -> None:
    report = crash_report(deaths)
    assert (report["loop"], report["repeats"], report["known"]) == (loop, repeats, known)
    assert report["flaky"] == (len(deaths) >= 2 and deaths[-1] != deaths[-2])
    assert report["error"] == deaths[-1]


def test_crash_suggestion_names_the_workaround_or_says_where_to_look() -> None:
    assert "--disable-cuda-graph" in crash_suggestion(crash_report([CUDA_GRAPH]))
    looping = crash_suggestion(crash_report(["KeyError: x"] * 3))
    assert "3 times" in looping and "will not fix" in looping
    assert "flaky" in crash_suggestion(crash_report(["KeyError: x"]))
    assert crash_suggestion(crash_report(["KeyError: x", "OSError: y"])).startswith("flaky")


@pytest.mark.parametrize(
    ("restarts", "now", "budget", "window_s", "allowed"),
    [
        ([], 0.0, 5, 3600.0, True),
        ([10.0, 20.0, 30.0, 40.0], 50.0, 5, 3600.0, True),
        ([10.0, 20.0, 30.0, 40.0, 50.0], 60.0, 5, 3600.0, False),  # five in the hour
        # Five unrelated crashes over two weeks never spend it.
        ([0.0, 3 * 86400.0, 6 * 86400.0, 9 * 86400.0, 12 * 86400.0], 14 * 86400.0, 5, 3600.0,
         True),
        ([10.0, 20.0, 30.0, 40.0, 50.0], 3611.0, 5, 3600.0, True),  # the first left the window
        ([], 0.0, 0, 3600.0, False),  # budget 0: never
    ],
)  # fmt: skip
def test_restart_budget_is_a_rate(
    restarts: list[float], now: float, budget: int, window_s: float, allowed: bool
) -> None:
    assert restart_allowed(restarts, now, budget, window_s) is allowed


HEALTHY_THEN_KILLED = [
    "[2026-11-30 21:04:11 TP0] Decode batch, #running-req: 40, #token: 81920, gen throughput",
    "[2026-11-30 21:04:12 TP0] Prefill batch, #new-seq: 4, #new-token: 512",
]


@pytest.mark.parametrize(
    ("log", "killed", "returncode", "crash"),
    [
        (SGLANG_DEATH, False, 1, True),  # its scheduler raised: a prompt may have caused it
        (SGLANG_DEATH, False, -signal.SIGKILL, True),  # SGLang's launcher kills its own tree
        (HEALTHY_THEN_KILLED, False, -signal.SIGKILL, False),  # SIGKILL, the OOM killer
        (HEALTHY_THEN_KILLED, False, -signal.SIGTERM, False),  # terminated from outside
        ([], False, -signal.SIGKILL, False),  # killed before a line
        (HEALTHY_THEN_KILLED, False, 1, True),  # it exited with an error code, saying nothing
        (HEALTHY_THEN_KILLED, False, 0, True),  # it exited, code 0, in the middle of serving
        ([], False, -signal.SIGSEGV, True),  # a fault it raised on itself
        ([], False, -signal.SIGABRT, True),  # an abort (a failed assertion in a kernel)
        (HEALTHY_THEN_KILLED, False, None, False),  # no exit status: nothing to go on
        (SGLANG_DEATH, True, 1, False),  # the watchdog killed it (a stall), whatever its log
        (HEALTHY_THEN_KILLED, True, 0, False),
    ],
    ids=[
        "own crash",
        "own crash, tree killed",
        "killed from outside",
        "terminated from outside",
        "killed, no log",
        "exit 1, silent",
        "exit 0, silent",
        "segfault",
        "abort",
        "no status",
        "killed by the watchdog",
        "killed by the watchdog, exit 0",
    ],
)
def test_only_the_engines_own_exit_can_be_a_prompts(
    log: list[str], killed: bool, returncode: int | None, crash: bool
) -> None:
    assert is_crash(last_error_line(log), killed, returncode) is crash
