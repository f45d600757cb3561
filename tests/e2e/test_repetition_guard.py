"""A real worker against an emulator where 5 % of prompts loop and 10 % repeat legitimately:
every loop is stopped within 2,000 tokens of its start and kept apart, no other answer is
stopped, and status, report and export say so.

Which prompts loop, and where, is the emulator's own plan for each prompt (its seed), read
with the emulator's functions: the ground truth the guard is held to. The worker draws these
answers by ids (`/v1/tokenize`, then `/generate`), so the seed is the one `/generate` draws:
of the prompt's ids as the emulator's own template and tokenizer render them.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import redis

from genfleet.common.settings import Settings
from genfleet.common.store import open_store
from genfleet.producer.report import build_report, render_report
from genfleet.producer.status import run_status
from genfleet.workers.engine.emulator.sim.chat_template import ChatTemplate
from genfleet.workers.engine.emulator.sim.generation_prompt import Family, derive
from genfleet.workers.engine.emulator.sim.text import draw_loop, draw_text_kind, prompt_ids_seed
from genfleet.workers.engine.emulator.sim.tokenizer import SimTokenizer
from genfleet.workers.engine.kinds import EMULATED_MODEL
from harness.env import base_env
from harness.processes import Worker
from harness.runs import export_rows, stage, wait_run_ended
from harness.sources import lines
from harness.waits import wait_for

pytestmark = [pytest.mark.integration, pytest.mark.slow]

PROMPTS = 200
LOOP_RATE = 0.05
LEGIT_RATE = 0.10
MAX_TOKENS = 8192


@functools.cache
def checkpoint() -> tuple[ChatTemplate, SimTokenizer, Family]:
    """The emulated model's template, tokenizer and generation prompts, as its engine loads
    them (`Engine.__init__`)."""
    template = ChatTemplate.from_checkpoint(EMULATED_MODEL)
    tokenizer = SimTokenizer.from_checkpoint(EMULATED_MODEL)
    return template, tokenizer, derive(template, tokenizer)


def planned(text: str) -> tuple[str, int, int]:
    """The emulator's plan for a prompt: its kind of answer and, for a loop, its first token
    and its block's tokens. Seeded as `/generate` seeds it (`Engine.plan_answer`): by the ids
    of the rendered prompt (thinking on: the template's default, so no template variable)."""
    template, tokenizer, family = checkpoint()
    messages = template.prepare_messages([{"role": "user", "content": text}])
    ids = tokenizer.encode(template.render(messages))
    seed = prompt_ids_seed(ids[: family.split(ids).prompt_len])
    kind = draw_text_kind(seed, LOOP_RATE, LEGIT_RATE)
    loop_at, block = draw_loop(seed, MAX_TOKENS) if kind == "loop" else (0, 0)
    return kind, loop_at, block


def test_loops_are_stopped_early_and_kept_apart_and_nothing_else_is(
    tmp_path: Path,
    redis_url: str,
    redis_client: redis.Redis,
    start_worker: Callable[..., Worker],
) -> None:
    texts = {
        f"q{n:04d}": f"Question {n}: list the first {n} primes and explain." for n in range(PROMPTS)
    }
    plans = {i: planned(text) for i, text in texts.items()}
    loops = {i for i, (kind, _, _) in plans.items() if kind == "loop"}
    legit = {i for i, (kind, _, _) in plans.items() if kind not in {"loop", "plain"}}
    assert len(loops) >= 4 and len(legit) >= 8  # the plan holds both kinds
    blocks = {plans[i][2] for i in loops}
    assert min(blocks) <= 5 and max(blocks) >= 300  # loops of a few words and of paragraphs
    source = lines(tmp_path / "prompts.jsonl", [{"id": i, "prompt": t} for i, t in texts.items()])
    store_url = (tmp_path / "store").as_uri()
    env = base_env(
        redis_url,
        store_url,
        emulator_loop_rate=LOOP_RATE,
        emulator_legit_repeat_rate=LEGIT_RATE,
        emulator_max_completion_tokens=MAX_TOKENS,
        emulator_mean_completion_tokens=600,
        max_tokens=MAX_TOKENS,
        batch_size=50,
    )
    worker = start_worker(env)
    settings = Settings(redis_url=redis_url, store=store_url, batch_size=50, max_tokens=MAX_TOKENS)
    stage(settings, "loops", source)
    worker.wait_ready()
    status = wait_run_ended(settings, redis_client, "loops", 180)
    assert status["state"] == "done", status

    _, exported = export_rows(settings, "loops", tmp_path / "all.jsonl", with_stopped=True)
    rows: dict[str, dict[str, Any]] = {row["id"]: row for row in exported}
    assert set(rows) == set(texts)
    stopped = {i for i, row in rows.items() if row["finish_reason"] == "repetition"}
    assert stopped == loops  # every loop stopped, and nothing else
    for i in stopped:
        row, loop_at = rows[i], plans[i][1]
        figures = row["repetition"]
        generated = row["usage"]["completion_tokens"]
        # Where the guard found the loop, in tokens at the answer's own characters a token:
        # what arrived after that point while a lagging reader caught up (one piece) is the
        # engine's pace, not the guard's.
        reasoning, content = row["reasoning"] or "", row["content"] or ""
        before = len(reasoning) if figures["field"] == "content" else 0
        found_at = (before + figures["chars"]) * generated / (len(reasoning) + len(content))
        assert found_at <= generated + 1
        assert found_at - loop_at <= 2000, (i, loop_at, round(found_at), figures)
        assert abs(figures["start_token_estimate"] - loop_at) <= max(50, plans[i][2])
        assert figures["tokens_saved"] == MAX_TOKENS - generated
        assert row["error"] is None and row["reasoning"]
    for i in legit:
        assert rows[i]["finish_reason"] in {"stop", "length"} and rows[i]["content"]

    result, kept = export_rows(settings, "loops", tmp_path / "kept.jsonl")
    assert result.stopped == result.stopped_left_out == len(loops)
    assert {row["id"] for row in kept} == set(texts)  # every row, a loop's without its text
    for row in kept:
        if row["id"] in loops:
            assert row["content"] is None and row["reasoning"] is None
            assert row["repetition"] == rows[row["id"]]["repetition"]
        else:
            assert row == rows[row["id"]]

    saved = sum(rows[i]["repetition"]["tokens_saved"] for i in loops)
    report = build_report(settings, "loops")
    assert render_report(report)  # the text tables take the new figures
    waste = report["waste"]
    assert report["stopped"] == waste["loops_stopped"] == len(loops)
    empty = [i for i, r in rows.items() if i not in loops and not (r["content"] or "").strip()]
    assert report["empty_answers"] == len(empty)  # a loop is not an empty answer either
    assert waste["tokens"]["stopped"] == sum(rows[i]["usage"]["completion_tokens"] for i in loops)
    assert waste["tokens_saved"] == saved
    # the live counters agree (written just after each output: waited for, not raced)
    store = open_store(store_url)
    live = wait_for(
        lambda: (
            (r := run_status(store, redis_client, "loops"))["waste"]["tokens"] == waste["tokens"]
            and r
        ),
        30,
        "the waste counters",
        0.2,
    )["waste"]
    assert (live["loops_stopped"], live["tokens_saved"]) == (len(loops), saved)
