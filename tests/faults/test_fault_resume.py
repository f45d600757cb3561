"""An answer cut mid-way goes on from the ids already drawn: after its engine dies, and after
its worker is SIGKILLed (from the answers its batch's checkpoint kept in flight).

The emulator draws each answer as a function of its prompt alone, token by token, like a
model at temperature 0 on a batch-invariant engine: an answer gone on from its ids is exactly
the one drawn uninterrupted, so each run here is compared with a twin run of the same
prompts drawn without a fault. A restarted answer would be equal too: what shows the ids were
gone on from is `resumed_tokens`, and the engine's request log (the continuations' inputs
hold the drawn ids)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import orjson
import pytest
import redis

from genfleet.common import keys
from genfleet.common.records import decode_jsonl_gz
from genfleet.common.redis_conn import text
from genfleet.common.settings import Settings
from harness.assertions import assert_exactly_once
from harness.env import base_env, free_port
from harness.processes import Worker
from harness.runs import fault_settings, open_run_store, stage, wait_run_done
from harness.sources import write_prompts
from harness.waits import wait_for

pytestmark = [pytest.mark.fault, pytest.mark.integration, pytest.mark.slow]

PROMPTS = 30
BUDGET = 400
LONG_BUDGET = 2000  # answers of seconds at the emulator's own pace: the kill lands mid-answer


def rows_of(settings: Any, run: str, ids: list[str], client: redis.Redis) -> dict[str, Any]:
    _, rows = assert_exactly_once(settings, run, ids, client)
    assert all(row["error"] is None for row in rows)
    return {row["id"]: row for row in rows}


def same_answers(cut: dict[str, Any], twin: dict[str, Any]) -> None:
    for name, row in cut.items():
        other = twin[name]
        assert (row["reasoning"], row["content"]) == (other["reasoning"], other["content"]), name
        assert row["finish_reason"] == other["finish_reason"], name
        assert row["usage"]["completion_tokens"] == other["usage"]["completion_tokens"], name
        assert row["usage"]["reasoning_tokens"] == other["usage"]["reasoning_tokens"], name
        assert "restarted" not in row


def dying_engine_worker(tmp_path: Path, redis_url: str, start_worker: Callable[..., Worker]) -> str:
    """A worker whose engine dies once (the marker file), when an answer has streamed 120
    tokens: every answer in flight is then part-way. Returns the store's URL."""
    store_url = (tmp_path / "store").as_uri()
    crash = f"--emulator-crash-after-tokens 120 --emulator-crash-once {tmp_path / 'crashed'}"
    env = base_env(
        redis_url,
        store_url,
        emulator_time_scale=20,
        emulator_mean_completion_tokens=300,
        max_tokens=BUDGET,
        engine_extra_args=crash,
        log_dir=tmp_path,
    )
    start_worker(env).wait_ready()
    return store_url


def test_an_engine_death_costs_no_drawn_token(
    tmp_path: Path,
    redis_url: str,
    redis_client: redis.Redis,
    start_worker: Callable[..., Worker],
) -> None:
    store_url = dying_engine_worker(tmp_path, redis_url, start_worker)
    settings = fault_settings(redis_url, store_url, max_tokens=BUDGET, batch_size=PROMPTS)
    ids = write_prompts(tmp_path / "prompts.jsonl", PROMPTS)
    stage(settings, "cut", tmp_path / "prompts.jsonl")
    wait_run_done(settings, redis_client, "cut", 120)
    assert (tmp_path / "crashed").exists(), "the engine never died"
    stage(settings, "twin", tmp_path / "prompts.jsonl")
    wait_run_done(settings, redis_client, "twin", 120)
    cut = rows_of(settings, "cut", ids, redis_client)
    twin = rows_of(settings, "twin", ids, redis_client)
    resumed = [row for row in cut.values() if row.get("resumed_tokens")]
    assert resumed, "no answer was cut part-way"
    assert len(resumed) >= PROMPTS // 2  # those in flight at the death, each part-way
    same_answers(cut, twin)
    assert not any(row.get("resumed_tokens") for row in twin.values())


def lose_a_worker(
    tmp_path: Path,
    redis_url: str,
    redis_client: redis.Redis,
    start_worker: Callable[..., Worker],
    kept: Callable[[Settings, str], bool],
    **worker_settings: Any,
) -> tuple[dict[str, Any], dict[str, Any]]:
    """A control worker and a GPU worker running run `lost` (one batch of long answers); once
    `kept(settings, batch)` says its answers in flight are kept, the GPU worker is SIGKILLed
    (holding the batch's lease) and a new one finishes the run. Then the same prompts as run
    `twin`, uninterrupted. Returns both runs' rows by id."""
    store_url = (tmp_path / "store").as_uri()
    env = base_env(
        redis_url,
        store_url,
        emulator_time_scale=3,
        emulator_mean_completion_tokens=1500,
        max_tokens=LONG_BUDGET,
        lease_ttl_s=3,
        reaper_interval_s=1,
        log_dir=tmp_path,
        **worker_settings,
    )
    start_worker(env, role="control").wait_ready()

    def gpu_worker() -> Worker:
        return start_worker({**env, "GENFLEET_PORT": str(free_port())}, name="gpu")

    first = gpu_worker()
    first.wait_ready()
    settings = fault_settings(redis_url, store_url, max_tokens=LONG_BUDGET, batch_size=PROMPTS)
    ids = write_prompts(tmp_path / "prompts.jsonl", PROMPTS)
    stage(settings, "lost", tmp_path / "prompts.jsonl")
    batch = keys.batch_id(0)
    wait_for(lambda: kept(settings, batch), 60, "the answers in flight kept", 0.05)
    holder = redis_client.get(keys.lease_key("lost", batch))
    assert holder is not None and text(holder) == first.hostname
    first.kill()
    first.proc.wait(timeout=10)
    gpu_worker().wait_ready()
    wait_run_done(settings, redis_client, "lost", 120)
    stage(settings, "twin", tmp_path / "prompts.jsonl")
    wait_run_done(settings, redis_client, "twin", 120)
    return rows_of(settings, "lost", ids, redis_client), rows_of(
        settings, "twin", ids, redis_client
    )


def test_a_lost_worker_costs_only_what_was_drawn_since_its_checkpoint(
    tmp_path: Path,
    redis_url: str,
    redis_client: redis.Redis,
    start_worker: Callable[..., Worker],
) -> None:
    def copied(settings: Settings, batch: str) -> bool:  # a part with answers in flight
        store = open_run_store(settings)
        return any(
            "drawn" in row
            for key in store.list(keys.parts_prefix("lost", batch))
            for row in decode_jsonl_gz(store.get(key) or b"")
        )

    lost, twin = lose_a_worker(
        tmp_path, redis_url, redis_client, start_worker, copied, checkpoint_interval_s=0.5
    )
    resumed = [row for row in lost.values() if row.get("resumed_tokens")]
    assert resumed, "no answer went on from the checkpoint"
    same_answers(lost, twin)


def test_a_lost_worker_between_two_checkpoints_costs_only_what_its_journal_had_not_kept(
    tmp_path: Path,
    redis_url: str,
    redis_client: redis.Redis,
    start_worker: Callable[..., Worker],
) -> None:
    """No checkpoint copy at all (one every 600 s): what the answers in flight drew reaches
    the next worker only through the batch's journal in Redis, and each answer goes on from
    its ids there, exactly as drawn uninterrupted."""

    def journaled(settings: Settings, batch: str) -> bool:  # lines, and still no copy
        total = 0
        for attempt in redis_client.hkeys(keys.drawn_journal_tries_key("lost", batch)):
            data = redis_client.get(keys.drawn_journal_key("lost", batch, text(attempt))) or b""
            for line in data.splitlines():
                total += sum(len(a["ids"]) for a in orjson.loads(line)["answers"])
        parts = open_run_store(settings).list(keys.parts_prefix("lost", batch))
        assert not list(parts), "a copy of the answers in flight was written"
        return total >= PROMPTS * 100

    lost, twin = lose_a_worker(
        tmp_path,
        redis_url,
        redis_client,
        start_worker,
        journaled,
        checkpoint_interval_s=600,
        inflight_journal_interval_s=0.2,
    )
    resumed = [row["resumed_tokens"] for row in lost.values() if row.get("resumed_tokens")]
    assert len(resumed) >= PROMPTS // 2, resumed  # every answer in flight went on
    assert sum(resumed) >= PROMPTS * 100 // 2
    same_answers(lost, twin)
    assert not redis_client.keys(keys.drawn_journal_tries_key("lost", "*") + "*")  # cleared


def test_an_answer_with_a_penalty_starts_over_and_says_why(
    tmp_path: Path,
    redis_url: str,
    redis_client: redis.Redis,
    start_worker: Callable[..., Worker],
) -> None:
    """A repetition penalty weighs every token drawn before: such an answer cannot go on from
    its ids, so after the engine's death it is drawn again from its start (by the chat
    endpoint), and its record says how many tokens that threw away and why."""
    store_url = dying_engine_worker(tmp_path, redis_url, start_worker)
    settings = fault_settings(
        redis_url, store_url, max_tokens=BUDGET, batch_size=PROMPTS, repetition_penalty=1.1
    )
    ids = write_prompts(tmp_path / "prompts.jsonl", PROMPTS)
    stage(settings, "penalty", tmp_path / "prompts.jsonl")
    wait_run_done(settings, redis_client, "penalty", 120)
    assert (tmp_path / "crashed").exists(), "the engine never died"
    rows = rows_of(settings, "penalty", ids, redis_client)
    restarted = [row["restarted"] for row in rows.values() if row.get("restarted")]
    assert len(restarted) >= PROMPTS // 2
    assert all(r["tokens"] > 0 and "repetition_penalty 1.1" in r["reason"] for r in restarted)
    assert not any(row.get("resumed_tokens") for row in rows.values())
