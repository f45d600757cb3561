"""The lines a person reads in Flower: a batch, a power-watch round, a finding (tables)."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
from celery.utils.saferepr import saferepr

from genfleet.workers.observe.diagnosis import engine_headline
from genfleet.workers.observe.headlines import (
    batch_headline,
    clock,
    duration,
    finding_line,
    flower_format_task,
    not_generated_headline,
    plural,
    summary_of,
    watch_headlines,
)

BATCH = {
    "run": "run",
    "batch": "batch-000004",
    "worker": "gpu@vm",
    "prompts": 30,
    "completions": 30,
    "errors": 0,
    "resumed": 0,
    "completion_tokens": 43586,
    "reasoning_tokens": 0,
    "duration_s": 33.2,
    "tokens_per_s": 4407.2,
    "skipped": False,
    "duplicate": False,
    "gpus": "0",
    "accept_length": 2.61,
    "finish_reasons": {"stop": 30},
}


@pytest.mark.parametrize(
    ("changes", "line"),
    [
        (
            {},
            "run/batch-000004: 30 prompts, 43,586 tok, 4,407 tok/s in 33 s, accept 2.6, "
            "gpu@vm GPU 0",
        ),
        (
            {
                "prompts": 1,
                "completion_tokens": 12,
                "tokens_per_s": 3.0,
                "duration_s": 4.0,
                "accept_length": None,
                "gpus": None,
            },
            "run/batch-000004: 1 prompt, 12 tok, 3 tok/s in 4 s, gpu@vm",
        ),
        (
            {"duration_s": 3725.0, "gpus": "0,1", "errors": 2, "resumed": 10},
            "run/batch-000004: 30 prompts, 43,586 tok, 4,407 tok/s in 1:02:05, accept 2.6, "
            "2 error records, 10 from a checkpoint, gpu@vm GPUs 0,1",
        ),
        (
            {"errors": 1},
            "run/batch-000004: 30 prompts, 43,586 tok, 4,407 tok/s in 33 s, "
            "accept 2.6, 1 error record, gpu@vm GPU 0",
        ),
        ({"skipped": True}, "run/batch-000004: already done (its output exists), gpu@vm GPU 0"),
        (
            {"duplicate": True, "accept_length": None},
            "run/batch-000004: 30 prompts, 43,586 tok, 4,407 tok/s in 33 s, "
            "another copy wrote the output first, gpu@vm GPU 0",
        ),
        (
            {
                "waste": {
                    "waste_kept_tokens": 33586,
                    "waste_stopped_tokens": 10000,
                    "waste_stopped_records": 2,
                    "waste_tokens_saved": 61440,
                }
            },
            "run/batch-000004: 30 prompts, 43,586 tok, 4,407 tok/s in 33 s, accept 2.6, "
            "kept 77%, 2 loops stopped (61,440 tok saved), gpu@vm GPU 0",
        ),
        (
            {"waste": {"waste_kept_tokens": 43586, "waste_kept_records": 30}},
            "run/batch-000004: 30 prompts, 43,586 tok, 4,407 tok/s in 33 s, accept 2.6, "
            "gpu@vm GPU 0",
        ),
    ],
)
def test_batch_headline(changes: dict[str, Any], line: str) -> None:
    assert batch_headline({**BATCH, **changes}) == line


UUID = "GPU-8f3a2b1c-1111-2222-3333-444455556666"


def finding(cause: str, **numbers: Any) -> dict[str, Any]:
    base = {
        "power_w": 140.0,
        "power_limit_w": 700.0,
        "queue_depth": 4,
        "inflight": 8,
        "inflight_cap": 8,
        "accept_length": 2.4,
    }
    return {
        "worker": "gpu@vm",
        "gpu_uuid": UUID,
        "verdict": "underused",
        "cause": cause,
        "numbers": {**base, **numbers},
        "suggestion": "long text",
        "ts": 0.0,
        "run": "r",
    }


@pytest.mark.parametrize(
    ("item", "line"),
    [
        (
            finding("client_limited"),
            "gpu@vm GPU-8f3a2b1c…: 20 % of 700 W, client_limited — raise --max-inflight",
        ),
        (
            finding("client_limited", queue_depth=0, active_batches=3),
            "gpu@vm GPU-8f3a2b1c…: 20 % of 700 W, client_limited — 3 batches reserved by this "
            "worker wait with 8/8 in flight: raise --max-inflight",
        ),
        (
            finding("client_limited", queue_depth=0, active_batches=1),
            "gpu@vm GPU-8f3a2b1c…: 20 % of 700 W, client_limited — 1 batch reserved by this "
            "worker waits with 8/8 in flight: raise --max-inflight",
        ),
        (
            finding("engine_capped"),
            "gpu@vm GPU-8f3a2b1c…: 20 % of 700 W, engine_capped — raise --max-running-requests",
        ),
        (
            finding(
                "engine_capped",
                cap_limit="configured",
                running=48,
                max_running_requests=48,
                cap_fix="raise --max-running-requests to 64",
            ),
            "gpu@vm GPU-8f3a2b1c…: 20 % of 700 W, engine_capped — raise --max-running-requests "
            "to 64",
        ),
        (
            finding(
                "engine_capped",
                cap_limit="state_pool",
                running=12,
                max_running_requests=12,
                cap_fix="--disable-radix-cache --max-running-requests 48",
            ),
            "gpu@vm GPU-8f3a2b1c…: 20 % of 700 W, engine_capped — the recurrent-state pool caps "
            "it at 12: --disable-radix-cache --max-running-requests 48",
        ),
        (
            finding(
                "engine_capped",
                cap_limit="kv",
                running=30,
                max_running_requests=48,
                cap_fix="shorter answers",
            ),
            "gpu@vm GPU-8f3a2b1c…: 20 % of 700 W, engine_capped — the KV cache admits no more: "
            "shorter answers",
        ),
        (
            finding("mtp_ineffective", accept_length=1.01),
            "gpu@vm GPU-8f3a2b1c…: 20 % of 700 W, accept 1.01, mtp_ineffective — check the "
            "checkpoints MTP weights (genfleet preflight)",
        ),
        (
            finding("engine_down", power_w=None),
            "gpu@vm GPU-8f3a2b1c…: engine_down — read the engine log",
        ),
        (
            {**finding("worker_unresponsive"), "gpu_uuid": None},
            "gpu@vm: not answering — check its process, broker and engine",
        ),
        (
            {**finding("starved"), "gpu_uuid": "EMU-4100-0"},
            "gpu@vm EMU-4100-0: 20 % of 700 W, starved — nothing queued: enqueue more or run "
            "fewer workers",
        ),
    ],
)
def test_finding_line(item: dict[str, Any], line: str) -> None:
    assert finding_line(item) == line


def row(verdict: str, tokens_per_s: float | None) -> dict[str, Any]:
    return {"worker": "gpu@vm", "verdict": verdict, "tokens_per_s": tokens_per_s}


@pytest.mark.parametrize(
    ("rows", "findings", "text"),
    [
        (
            [row("underused", 5164.4)],
            [finding("client_limited")],
            "1 of 1 GPU underused: client_limited; fleet 5,164 tok/s\n"
            "gpu@vm GPU-8f3a2b1c…: 20 % of 700 W, client_limited — raise --max-inflight",
        ),
        ([row("ok", 6000.0), row("ok", 6100.0)], [], "fleet 12,100 tok/s; 0 of 2 GPUs underused"),
        (
            [row("ok", 6000.0), row("unresponsive", None)],
            [
                {
                    **finding("worker_unresponsive"),
                    "worker": "gpu1@vm",
                    "gpu_uuid": None,
                    "verdict": "unresponsive",
                }
            ],
            "fleet 6,000 tok/s; 0 of 1 GPU underused\n"
            "gpu1@vm: not answering — check its process, broker and engine",
        ),
        ([row("idle", None)], [], "fleet 0 tok/s; 0 of 1 GPU underused"),
        ([], [], "fleet: no GPU worker answered"),
    ],
)
def test_watch_headlines(
    rows: list[dict[str, Any]], findings: list[dict[str, Any]], text: str
) -> None:
    assert watch_headlines(rows, findings) == text


@pytest.mark.parametrize(
    ("seconds", "as_clock", "as_duration"),
    [
        (0, "0:00:00", "0 s"),
        (33.4, "0:00:33", "33 s"),
        (75, "0:01:15", "0:01:15"),
        (3725, "1:02:05", "1:02:05"),
        (-3, "0:00:00", "-3 s"),
    ],
)
def test_clock_and_duration(seconds: float, as_clock: str, as_duration: str) -> None:
    assert clock(seconds) == as_clock
    assert duration(seconds) == as_duration


def test_plural() -> None:
    assert [
        plural(1, "batch", "batches"),
        plural(3, "batch", "batches"),
        plural(1024, "prompt"),
    ] == ["1 batch", "3 batches", "1,024 prompts"]


def test_flower_shows_the_summary_of_the_repr_the_worker_sends() -> None:
    text = watch_headlines([row("underused", 5164.4)], [finding("client_limited")])
    result = {"summary": text, "ts": 1.0, "verdicts": [row("ok", 1.0)] * 100}
    sent = saferepr(result, 1024)  # what a worker puts in its task-succeeded event
    assert summary_of(sent) == text
    task = flower_format_task(SimpleNamespace(result=sent))
    assert task.result == text.replace("\n", " | ")
    # anything else is left alone
    other = SimpleNamespace(result="{'requeued': [], 'finished': []}")
    assert flower_format_task(other).result == "{'requeued': [], 'finished': []}"
    assert summary_of(None) is None


@pytest.mark.parametrize(
    ("queue_depth", "says"),
    [(4, "work waits (4 orders queued)"), (0, "work waits (3 batches reserved by this worker)")],
)
def test_client_limited_advice_says_what_waits(queue_depth: int, says: str) -> None:
    from genfleet.workers.observe.diagnosis import FleetState, diagnose

    engine = {
        "up": True,
        "inflight": 8,
        "inflight_cap": 8,
        "running": 8,
        "queued": 0,
        "max_running_requests": 48,
        "speculative_algorithm": "EAGLE",
        "accept_length": 2.5,
        "active_batches": 3,
        "runs": ["r"],
    }
    gpu = {"gpu_uuid": UUID, "gpu_name": "H200", "power_w": 150.0, "power_limit_w": 700.0}
    samples = {"w": {"ts": 100.0, "gpus": [gpu], "engine": engine, "tokens_per_s": 900.0}}
    [found] = diagnose(samples, FleetState(queue_depth=queue_depth), 100.0)
    assert found.cause == "client_limited"
    assert found.suggestion.startswith(says), found.suggestion
    assert ("reserved by this worker" in finding_line(found.to_json())) == (queue_depth == 0)


@pytest.mark.parametrize(
    ("result", "line"),
    [
        (
            {
                "run": "r",
                "batch": "batch-000001",
                "hand_back": True,
                "handed_back": True,
                "queue": "gpu.emulator",
            },
            "r/batch-000001: an order for another model: handed back to gpu.emulator",
        ),
        (
            {"run": "r", "batch": "batch-000001", "drop": True},
            "r/batch-000001: its run was deleted: dropped",
        ),
        (
            {"run": "r", "batch": "batch-000001", "cancelled": True},
            "r/batch-000001: the run is cancelled: parked (enqueue --resume resumes it)",
        ),
        (
            {"run": "r", "batch": "batch-000001", "park": True},
            "r/batch-000001: the run is cancelled: parked (enqueue --resume resumes it)",
        ),
    ],
)
def test_not_generated_headline(result: dict[str, Any], line: str) -> None:
    assert not_generated_headline(result) == line


@pytest.mark.parametrize(
    ("engine", "line"),
    [
        ({"up": True, "inflight": 48, "inflight_cap": 64}, "ready: 48 of 64 in flight, 0 restarts"),
        ({"up": False, "restarting": True, "restarts": 2}, "restarting (restarts so far: 2)"),
        ({"up": False}, "down"),
        (
            {
                "up": False,
                "exhausted": True,
                "restarts_in_window": 5,
                "restart_window_s": 3600.0,
                "cooldown_left_s": 540.0,
                "crash": {"error": "RuntimeError: boom", "loop": False},
            },
            "RESTART BUDGET SPENT: restart budget spent (5 in 3600 s), back in 540 s: "
            "RuntimeError: boom",
        ),
        (
            {"up": True, "crash": {"error": "RuntimeError: boom", "loop": True, "repeats": 3}},
            "CRASH LOOP: crash loop (3 times): RuntimeError: boom — ",
        ),
    ],
)
def test_engine_headline(engine: dict[str, Any], line: str) -> None:
    """The engine line of a worker's `stats` (Flower's worker page): its alarm first."""
    assert engine_headline(engine).startswith(line)
