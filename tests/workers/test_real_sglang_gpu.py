"""genfleet on real SGLang, on a GPU: each test runs the engine genfleet's supervisor starts.

Deselected by default (`-m gpu`), never in CI. Needs an NVIDIA GPU, an importable `sglang`
(`bench/real_sglang/device.sh setup` unpacks 0.5.15), `redis-server` on PATH and the
checkpoints `bench/real_sglang/build_model.py` writes under `$GENFLEET_GPU_MODELS` (default
/tmp/m): `q35` (Qwen3.6 layout, `mtp.*` tensors, random weights), `q35_nomtp` (the same without
them) and `dense` (Qwen3). The whole module is skipped where any of that is missing.

    python3 -m pytest -q -m gpu tests/workers/test_real_sglang_gpu.py

One worker stack (Redis, a GPU worker, the control worker) on the hybrid checkpoint with MTP
serves the tests that share it, in file order: a run end to end, what the engine reports,
the MTP finding, a frozen scheduler, an engine killed mid-batch. Random weights: texts are
noise and the draft is never accepted (accept length 1.0), which is what MTP INEFFECTIVE is for.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from functools import partial
from pathlib import Path
from typing import Any

import httpx
import pytest

from genfleet.common.settings import Settings
from genfleet.workers.engine.kinds import engine_launch
from genfleet.workers.engine.ports import pick_port
from genfleet.workers.engine.supervisor import EngineSupervisor
from genfleet.workers.observe.engine_state import enforced_cap
from harness import continuation
from harness.assertions import assert_exactly_once
from harness.env import ROOT, engine_port_base, free_port
from harness.processes import pid_alive
from harness.services import RedisServer
from harness.waits import wait_for
from tests.support.commands import genfleet
from tests.support.real_sglang import (
    ENGINE_ENV,
    MODELS,
    Stack,
    agreement,
    answers,
    done,
    lose_worker,
    missing,
    wait_drawn,
    worker_stack,
)

Q35, Q35_NOMTP, DENSE = MODELS / "q35", MODELS / "q35_nomtp", MODELS / "dense"

if (_why := missing((Q35, Q35_NOMTP, DENSE))) is not None:
    pytest.skip(f"real SGLang tests: {_why}", allow_module_level=True)

pytestmark = [pytest.mark.gpu, pytest.mark.integration, pytest.mark.slow]


def queued(base_url: str) -> float:
    """`sglang:num_queue_reqs` from the engine's /metrics (summed over its label sets)."""
    text = httpx.get(f"{base_url}/metrics", timeout=10).text
    lines = [line for line in text.splitlines() if line.startswith("sglang:num_queue_reqs{")]
    return sum(float(line.rsplit(" ", 1)[1]) for line in lines)


@pytest.fixture(scope="module")
def mtp_stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    tmp = tmp_path_factory.mktemp("mtp")
    # MTP given: the engine plan keeps it (it would choose by its estimate otherwise).
    # Answers in flight checkpointed every 3 s, leases of 20 s: a lost worker's batch moves on
    # within the test's time, and its answers go on from what was kept.
    with worker_stack(
        tmp,
        Q35,
        "gpu0@h200",
        30200,
        GENFLEET_ENGINE_STALL_TIMEOUT_S="20",
        GENFLEET_MTP="true",
        GENFLEET_CHECKPOINT_INTERVAL_S="3",
        GENFLEET_LEASE_TTL_S="20",
        GENFLEET_REAPER_INTERVAL_S="5",
    ) as s:
        yield s


def test_preflight_accepts_mtp_tensors_and_refuses_without(tmp_path: Path) -> None:
    env = {**os.environ, **ENGINE_ENV, "GENFLEET_LOG_DIR": str(tmp_path)}
    ok = genfleet(["preflight", "--model", str(Q35), "--json"], env, timeout_s=120)
    assert ok.returncode == 0, ok.stderr
    assert json.loads(ok.stdout)["mtp_tensors"] >= 1
    refused = genfleet(["preflight", "--model", str(Q35_NOMTP), "--json"], env, timeout_s=120)
    assert refused.returncode == 1 and "--no-mtp" in refused.stderr
    server = RedisServer(tmp_path, free_port(), "gpu-tests")
    server.start()
    worker = subprocess.run(
        [sys.executable, "-m", "genfleet.workers", "worker", "--model", str(Q35_NOMTP)],
        env={**env, "GENFLEET_REDIS_URL": server.url, "GENFLEET_STORE": f"file://{tmp_path}/s"},
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    server.kill()
    assert worker.returncode == 1 and "PreflightError" in worker.stderr
    assert not list(tmp_path.glob("engine-*.log"))  # refused before any engine started


def test_a_full_queue_answers_as_sglang_does(tmp_path: Path) -> None:
    """`--max-queued-requests`: what real SGLang answers once its queue is full (503, the
    emulator's contract), streamed and not."""
    settings = Settings(
        model=str(DENSE),
        engine="sglang",
        mtp=False,
        attention_backend="triton",
        max_running_requests=1,
        engine_extra_args=ENGINE_ENV["GENFLEET_ENGINE_EXTRA_ARGS"]
        + " --max-queued-requests 1 --disable-cuda-graph",
    )
    port = pick_port("127.0.0.1", engine_port_base())  # SGLang's --port: 55535 at most
    launch = engine_launch(settings, port)
    assert launch is not None
    engine = EngineSupervisor(
        launch, gpus="0", log_path=tmp_path / "engine.log", startup_timeout_s=300
    )
    engine.start()
    body = {
        "messages": [{"role": "user", "content": "x"}],
        "max_tokens": 3000,
        "ignore_eos": True,
        "stream": True,
    }
    stop = threading.Event()

    def hold() -> None:
        with contextlib.suppress(httpx.HTTPError):
            with httpx.stream("POST", f"{launch.base_url}/v1/chat/completions", json=body) as r:
                for _ in r.iter_bytes():
                    if stop.is_set():
                        return

    holders = [threading.Thread(target=hold, daemon=True) for _ in range(2)]
    try:
        for holder in holders:  # one running, one queued
            holder.start()
        wait_for(lambda: queued(launch.base_url) >= 1, 60, "one request queued", 0.2)
        r = httpx.post(
            f"{launch.base_url}/v1/chat/completions", json=body | {"stream": False}, timeout=60
        )
        assert r.status_code == 503, r.text
        assert r.json()["message"] == "The request queue is full."
    finally:
        stop.set()
        for holder in holders:
            holder.join(timeout=30)
        engine.stop()


def test_the_engine_is_ready_on_sglangs_ready_line_before_its_health_answers(
    tmp_path: Path,
) -> None:
    """SGLang logs `The server is fired up and ready to roll!` as its status turns Up; its
    /health then sleeps a second before its 200. The supervisor is ready on the line."""
    settings = Settings(
        model=str(DENSE),
        engine="sglang",
        mtp=False,
        attention_backend="triton",
        engine_extra_args=ENGINE_ENV["GENFLEET_ENGINE_EXTRA_ARGS"] + " --disable-cuda-graph",
    )
    launch = engine_launch(settings, pick_port("127.0.0.1", engine_port_base()))
    assert launch is not None
    engine = EngineSupervisor(
        launch, gpus="0", log_path=tmp_path / "engine.log", startup_timeout_s=300
    )
    try:
        engine.start()
        assert engine.ready_by == "line"
        asked = time.monotonic()
        health = httpx.get(f"{launch.base_url}/health", timeout=30)
        health_s = time.monotonic() - asked
        assert health.status_code == 200
        assert health_s >= 0.9  # what a readiness poll of /health would have waited more
        print(
            f"\n[real sglang ready line] ready {engine.last_start_s:.1f} s after the spawn, on "
            f"its ready line; /health answered 200 {health_s:.2f} s after it was asked"
        )
    finally:
        engine.stop()


def test_no_mtp_raises_no_mtp_finding(tmp_path: Path) -> None:
    with worker_stack(tmp_path, DENSE, "dense0@h200", 30300, GENFLEET_MTP="false") as stack:
        ids = stack.run("dense", 100, tmp_path)
        wait_for(lambda: stack.progress("dense")["state"] == "done", 240, "run dense", 1.0)
        assert_exactly_once(stack.settings, "dense", ids, stack.client)
        info = httpx.get(f"{stack.engine_url}/server_info", headers=stack.auth, timeout=30).json()
        assert info["speculative_algorithm"] is None
        judged = time.monotonic() + 12  # two power-watch passes after the run
        wait_for(lambda: time.monotonic() > judged, 20, "two power-watch passes", 0.5)
        assert not stack.findings("mtp_ineffective")


def test_run_end_to_end_with_mtp(mtp_stack: Stack, tmp_path: Path) -> None:
    ids = mtp_stack.run("e2e", 300, tmp_path)
    wait_for(lambda: mtp_stack.progress("e2e")["state"] == "done", 300, "run e2e", 1.0)
    _, rows = assert_exactly_once(mtp_stack.settings, "e2e", ids, mtp_stack.client)
    assert all(row["error"] is None for row in rows)
    assert {row["finish_reason"] for row in rows} <= {"stop", "length"}
    usage = [row["usage"] for row in rows]
    assert all(u["completion_tokens"] > 0 and u["prompt_tokens"] > 0 for u in usage)
    # SGLang reports reasoning tokens in usage; the qwen3 parser split the text.
    assert all(u.get("reasoning_tokens") is not None for u in usage)
    assert sum(u["reasoning_tokens"] for u in usage) > 0
    assert any(row.get("reasoning") for row in rows)
    assert all(u["reasoning_tokens"] <= u["completion_tokens"] for u in usage)


def test_accept_length_and_cap_read_from_the_real_engine(mtp_stack: Stack) -> None:
    # SGLang folds its accept length in every 40 decode steps (`--decode-log-interval`): one
    # answer of 128 tokens first (over 100 steps at a random draft's ~1.0), so the test holds
    # when it runs alone too (16 tokens did not).
    httpx.post(
        f"{mtp_stack.engine_url}/v1/chat/completions",
        json={
            "messages": [{"role": "user", "content": "warm"}],
            "max_tokens": 128,
            "ignore_eos": True,
        },
        headers=mtp_stack.auth,
        timeout=120,
    ).raise_for_status()
    info = httpx.get(f"{mtp_stack.engine_url}/server_info", headers=mtp_stack.auth, timeout=30)
    info = info.json()
    assert info["speculative_algorithm"] == "EAGLE"
    assert info["max_running_requests"] == 256
    # The engine plan's cap is what the engine enforces (a cut plan would be a finding).
    assert enforced_cap(info) == 256 and info["disable_radix_cache"] is True
    assert mtp_stack.findings("engine_plan_cut") == []
    state = info["internal_states"][0]
    assert 1.0 <= state["avg_spec_accept_length"] < 1.2  # random draft weights
    metrics = httpx.get(f"{mtp_stack.engine_url}/metrics", headers=mtp_stack.auth, timeout=30).text
    for name in ("sglang:num_running_reqs", "sglang:spec_accept_length", "sglang:num_queue_reqs"):
        assert any(line.startswith(name + "{") for line in metrics.splitlines()), name
    top = subprocess.run(
        [sys.executable, "-m", "genfleet.workers", "top", "--once", "--json"],
        env=mtp_stack.env,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert top.returncode == 0, top.stderr
    rows = json.loads(top.stdout)
    rows = rows if isinstance(rows, list) else [rows]
    caps = {row.get("inflight_cap") for row in rows if row.get("worker") == "gpu0@h200"}
    assert caps == {324}, rows  # sized from the enforced cap: 256 x 1.25 + 4


def test_mtp_ineffective_on_random_draft_weights(mtp_stack: Stack, tmp_path: Path) -> None:
    """The power-watch judges a GPU while work waits for it: a run keeps it busy meanwhile."""
    mtp_stack.run("mtp", 2000, tmp_path)
    wait_for(lambda: bool(mtp_stack.findings("mtp_ineffective")), 120, "mtp_ineffective", 1.0)
    wait_for(lambda: mtp_stack.progress("mtp")["state"] == "done", 300, "run mtp", 1.0)


def test_streamed_chat_shapes(mtp_stack: Stack) -> None:
    """Streamed chat on the real engine, for the streaming client: role chunk first, reasoning
    deltas from the parser, one finish reason, a usage chunk with no choices, then [DONE]."""
    body = {
        "messages": [{"role": "user", "content": "stream me"}],
        "stream": True,
        "stream_options": {"include_usage": True},
        "max_tokens": 40,
    }
    events: list[Any] = []
    url = f"{mtp_stack.engine_url}/v1/chat/completions"
    with httpx.stream("POST", url, json=body, headers=mtp_stack.auth) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        for line in r.iter_lines():
            if line.startswith("data: "):
                data = line[len("data: ") :]
                events.append(data if data == "[DONE]" else json.loads(data))
    assert events[-1] == "[DONE]"
    chunks = events[:-1]
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    finish = [c for c in chunks if c["choices"] and c["choices"][0]["finish_reason"]]
    assert len(finish) == 1
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] > 0
    out = Path(os.environ.get("GENFLEET_GPU_OUT", "/tmp"))
    (out / "stream_events.json").write_text(json.dumps(events, indent=1))


def test_stall_watchdog_replaces_a_frozen_scheduler(mtp_stack: Stack, tmp_path: Path) -> None:
    frozen = mtp_stack.engine_pid()
    # Answers of 2,048 tokens: the freeze lands with requests in flight, not after the run.
    ids = mtp_stack.run("stall", 200, tmp_path, max_tokens=2048)
    assert mtp_stack.in_flight("stall", ids) > 0
    os.killpg(os.getpgid(frozen), signal.SIGSTOP)
    stopped_at = time.monotonic()
    try:
        wait_for(lambda: bool(mtp_stack.findings("engine_stalled")), 120, "engine_stalled", 0.5)
        found_s = time.monotonic() - stopped_at
        wait_for(lambda: not pid_alive(frozen), 60, "the frozen engine gone", 0.5)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(os.getpgid(frozen), signal.SIGCONT)
    # Stopped, its whole group spends no CPU time: found by that, not by the window.
    numbers = mtp_stack.findings("engine_stalled")[0]["numbers"]
    print(f"\n[gpu stall] found {found_s:.1f} s after SIGSTOP: {numbers}")
    assert str(numbers["health"]).startswith("no CPU time"), numbers
    wait_for(lambda: mtp_stack.progress("stall")["state"] == "done", 420, "run stall", 1.0)
    assert mtp_stack.engine_pid() != frozen
    _, rows = assert_exactly_once(mtp_stack.settings, "stall", ids, mtp_stack.client)
    assert all(row["error"] is None for row in rows)


def test_engine_killed_mid_batch_is_restarted_and_its_prompts_done_once(
    mtp_stack: Stack, tmp_path: Path
) -> None:
    killed = mtp_stack.engine_pid()
    ids = mtp_stack.run("kill", 200, tmp_path, max_tokens=2048)
    assert mtp_stack.in_flight("kill", ids) > 0
    os.killpg(os.getpgid(killed), signal.SIGKILL)
    wait_for(lambda: mtp_stack.progress("kill")["state"] == "done", 420, "run kill", 1.0)
    assert mtp_stack.engine_pid() != killed
    _, rows = assert_exactly_once(mtp_stack.settings, "kill", ids, mtp_stack.client)
    assert all(row["error"] is None for row in rows)


def test_answers_cut_by_an_engine_kill_go_on_from_their_ids(
    mtp_stack: Stack, tmp_path: Path
) -> None:
    """Temperature 0: two uninterrupted runs of the same prompts, then a third with the engine
    killed mid-answer. The cut answers go on from their ids (resumed_tokens, the whole budget
    drawn, nothing started over) and agree with the first run as far as the second does."""
    count, budget = 48, 768
    twins = []
    for run in ("twin-a", "twin-b"):
        ids = mtp_stack.run(run, count, tmp_path, budget, prefix="q-", temperature=0.0)
        wait_for(partial(done, mtp_stack, run), 300, run, 1.0)
        twins.append(answers(mtp_stack, run, ids))
    killed = mtp_stack.engine_pid()
    ids = mtp_stack.run("cut", count, tmp_path, budget, prefix="q-", temperature=0.0)
    wait_drawn(mtp_stack, "cut", ids)
    os.killpg(os.getpgid(killed), signal.SIGKILL)
    wait_for(lambda: mtp_stack.progress("cut")["state"] == "done", 420, "run cut", 1.0)
    cut = answers(mtp_stack, "cut", ids)
    resumed = {k: r for k, r in cut.items() if r.get("resumed_tokens")}
    figures: dict[str, Any] = {
        "twins": agreement(twins[1], twins[0]),
        "resumed_vs_twin": agreement(resumed, twins[0]),
        "resumed_tokens": sorted(r["resumed_tokens"] for r in resumed.values()),
        "restarted": sum(1 for r in cut.values() if r.get("restarted")),
    }
    out = Path(os.environ.get("GENFLEET_GPU_OUT", "/tmp"))
    (out / "resume_engine_kill.json").write_text(json.dumps(figures, indent=1))
    assert resumed, "no answer was cut mid-way"
    assert figures["restarted"] == 0
    print("RESUME_ENGINE_KILL", json.dumps(figures))
    for row in resumed.values():  # the budget carried: drawn before + after, never more
        tokens = row["usage"]["completion_tokens"]
        assert tokens == budget if row["finish_reason"] == "length" else tokens < budget
    twins_same = figures["twins"]["identical"] / count
    resumed_same = figures["resumed_vs_twin"]["identical"] / len(resumed)
    assert resumed_same >= twins_same - 0.25, figures


def test_answers_of_a_lost_worker_go_on_from_its_checkpoint(
    mtp_stack: Stack, tmp_path: Path
) -> None:
    """The worker and its engine SIGKILLed mid-answer: a new worker takes the batch once its
    lease is out and goes on from the answers its checkpoint kept in flight."""
    ids = mtp_stack.run("lost", 48, tmp_path, 1024, temperature=0.0)
    rows = lose_worker(mtp_stack, "lost", ids, tmp_path / "worker2.log", "gpu0b@h200", 420)
    resumed = [r for r in rows.values() if r.get("resumed_tokens")]
    out = Path(os.environ.get("GENFLEET_GPU_OUT", "/tmp"))
    (out / "resume_worker_kill.json").write_text(
        json.dumps({"resumed": len(resumed), "tokens": [r["resumed_tokens"] for r in resumed]})
    )
    print("RESUME_WORKER_KILL", len(resumed), sorted(r["resumed_tokens"] for r in resumed))
    assert resumed, "no answer went on from the checkpoint"
    for row in resumed:
        tokens = row["usage"]["completion_tokens"]
        assert tokens == 1024 if row["finish_reason"] == "length" else tokens < 1024


def test_a_continuation_by_ids_draws_what_one_uninterrupted_draw_does(
    mtp_stack: Stack, tmp_path: Path
) -> None:
    """No fault: 48 prompts drawn whole twice in one batch, once in halves, and drawn to 193
    tokens then on from prompt + those ids, greedy, compared id by id
    (`harness/continuation.py`). Going on from ids agrees with the first draw as far as a draw
    in another batch composition does: two draws of one batch agreed bit for bit on an H100
    (48 of 48) where every continuation parted 2-194 tokens after its cut."""
    limits = httpx.Limits(max_connections=64)

    async def measure() -> dict[str, Any]:
        async with httpx.AsyncClient(
            base_url=mtp_stack.engine_url, headers=mtp_stack.auth, timeout=600, limits=limits
        ) as client:
            engine = continuation.Engine(client, str(Q35))
            return await continuation.probe(engine, continuation.texts(48), 768, 193)

    figures = asyncio.run(measure())
    out = Path(os.environ.get("GENFLEET_GPU_OUT", "/tmp"))
    (out / "resume_ids.json").write_text(json.dumps(figures, indent=1))
    print("RESUME_IDS", json.dumps(figures))
    twins = figures["twins_other_batch"]["identical"]
    assert figures["distinct_ids_p50"] > 20, figures  # text, not a few ids repeated
    assert figures["heads_vs_twin"]["identical"] >= twins - 12, figures
    assert figures["continued_vs_twin"]["identical"] >= twins - 12, figures
