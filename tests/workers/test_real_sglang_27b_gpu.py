"""genfleet on real SGLang at the real model's size: the 27B shape (Qwen3.5/3.6-27B layout,
`bench/real_sglang/build_27b.py`: config and tokenizer, SGLang's `--load-format dummy`), its
engine launched by the worker's supervisor from the engine plan, on a GPU of 80 GB or more.

Deselected by default (`-m gpu`), never in CI; skipped where `$GENFLEET_GPU_MODELS/q36_27b`
(default /tmp/m) is missing. A module of its own: the small model's stack of
`test_real_sglang_gpu.py` holds the GPU until that module's last test.

    OUT=$OUT bash bench/real_sglang/big.sh build   # writes the 27B shape to /tmp/m/q36_27b
    TESTS_FILES=tests/workers/test_real_sglang_27b_gpu.py bash bench/real_sglang/device.sh tests
"""

from __future__ import annotations

import json
import os
import signal
from collections.abc import Iterator
from functools import partial
from pathlib import Path
from typing import Any

import pytest

from harness.waits import wait_for
from tests.support import real_sglang as gpu
from tests.support.real_sglang import Stack

BIG = gpu.MODELS / "q36_27b"

if (_why := gpu.missing((BIG,))) is not None:
    pytest.skip(f"real SGLang tests at 27B: {_why}", allow_module_level=True)

pytestmark = [pytest.mark.gpu, pytest.mark.integration, pytest.mark.slow]


@pytest.fixture(scope="module")
def big_stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    """The worker launches the engine plan's cap, MTP off (as the plan chooses on an H100) and
    0.9 of the card: the small model's 0.6 would not hold the 27B's 51 GiB of weights."""
    tmp = tmp_path_factory.mktemp("big")
    extra = gpu.ENGINE_ENV["GENFLEET_ENGINE_EXTRA_ARGS"] + " --load-format dummy"
    with gpu.worker_stack(
        tmp,
        BIG,
        "gpu0@big",
        30210,
        GENFLEET_ENGINE_EXTRA_ARGS=extra,
        GENFLEET_MEM_FRACTION_STATIC="0.9",
        GENFLEET_MTP="false",
        GENFLEET_MAX_TOKENS="1024",
        GENFLEET_ENGINE_STALL_TIMEOUT_S="120",
        GENFLEET_CHECKPOINT_INTERVAL_S="3",
        # Random weights repeat one token: the guard would stop every answer long before the
        # cut, and the export keeps no text of a stopped one to compare.
        GENFLEET_REPETITION_GUARD="false",
    ) as s:
        yield s


COUNT, BUDGET = 64, 1024


@pytest.fixture(scope="module")
def twin(big_stack: Stack, tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, Any]]:
    """The prompts of both tests drawn once without a fault, at temperature 0."""
    tmp = tmp_path_factory.mktemp("twin")
    ids = big_stack.run("twin", COUNT, tmp, BUDGET, prefix="q-", temperature=0.0)
    wait_for(partial(gpu.done, big_stack, "twin"), 600, "run twin", 1.0)
    return gpu.answers(big_stack, "twin", ids)


def figures_of(cut: dict[str, dict[str, Any]], twin: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """How the answers that went on from their ids compare with the uninterrupted run's."""
    resumed = {k: r for k, r in cut.items() if r.get("resumed_tokens")}
    return {
        "resumed_vs_twin": gpu.agreement(resumed, twin),
        "resumed_tokens": sorted(r["resumed_tokens"] for r in resumed.values()),
        "restarted": sum(1 for r in cut.values() if r.get("restarted")),
    }


def assert_went_on(cut: dict[str, dict[str, Any]], figures: dict[str, Any]) -> None:
    """Some answers went on from their ids, none started over, each within its budget."""
    resumed = [r for r in cut.values() if r.get("resumed_tokens")]
    assert resumed, "no answer was cut mid-way"
    assert figures["restarted"] == 0
    for row in resumed:  # the budget carried: drawn before + after, never more
        tokens = row["usage"]["completion_tokens"]
        assert tokens == BUDGET if row["finish_reason"] == "length" else tokens < BUDGET


def keep(name: str, figures: dict[str, Any]) -> None:
    out = Path(os.environ.get("GENFLEET_GPU_OUT", "/tmp"))
    (out / f"{name}.json").write_text(json.dumps(figures, indent=1))
    print(name.upper(), json.dumps(figures))


def test_answers_of_the_27b_cut_by_an_engine_kill_go_on_from_their_ids(
    big_stack: Stack, twin: dict[str, dict[str, Any]], tmp_path: Path
) -> None:
    """Temperature 0: the prompts of the uninterrupted run again, the engine SIGKILLed
    mid-answer. The cut answers go on from their ids on the restarted 27B engine (its budget
    carried, nothing started over), each prompt once; how many equal the uninterrupted run's
    is measured (`resume_27b.json`)."""
    engine = big_stack.engine_pid()
    ids = big_stack.run("cut", COUNT, tmp_path, BUDGET, prefix="q-", temperature=0.0)
    gpu.wait_drawn(big_stack, "cut", ids)
    os.killpg(os.getpgid(engine), signal.SIGKILL)
    wait_for(partial(gpu.done, big_stack, "cut"), 900, "run cut", 1.0)
    cut = gpu.answers(big_stack, "cut", ids)
    figures = figures_of(cut, twin)
    keep("resume_27b", figures)
    assert_went_on(cut, figures)


def test_two_uninterrupted_27b_runs_agree_as_far_as_measured(
    big_stack: Stack, twin: dict[str, dict[str, Any]], tmp_path: Path
) -> None:
    """The other half of "measure both": the same prompts drawn again without a fault, in the
    same batches, against the uninterrupted run (`twins_27b.json`): how far two draws agree
    with each other, beside how far the continued ones agree with one."""
    ids = big_stack.run("again", COUNT, tmp_path, BUDGET, prefix="q-", temperature=0.0)
    wait_for(partial(gpu.done, big_stack, "again"), 600, "run again", 1.0)
    again = gpu.answers(big_stack, "again", ids)
    figures = {"again_vs_twin": gpu.agreement(again, twin)}
    keep("twins_27b", figures)
    assert not any(r.get("resumed_tokens") for r in again.values())


def test_answers_of_a_lost_27b_worker_go_on_from_its_checkpoint(
    big_stack: Stack, twin: dict[str, dict[str, Any]], tmp_path: Path
) -> None:
    """The worker and its 27B engine SIGKILLed mid-answer: a new worker (its own engine, the
    plan's) takes the batch once its lease is out and goes on from the answers its checkpoint
    kept in flight (`resume_27b_worker_kill.json`). Last in the module: the stack's worker is
    gone after it."""
    ids = big_stack.run("lost", COUNT, tmp_path, BUDGET, prefix="q-", temperature=0.0)
    cut = gpu.lose_worker(big_stack, "lost", ids, tmp_path / "worker2.log", "gpu0b@big", 600)
    figures = figures_of(cut, twin)
    keep("resume_27b_worker_kill", figures)
    assert_went_on(cut, figures)
