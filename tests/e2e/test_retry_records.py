"""`genfleet retry RUN --errors / --stopped / --cut` on a real worker and the emulator.

A run where the emulator aborts some answers (error records: no request retries), loops in
others (the repetition guard stops them) and runs past max_tokens in others (cut). Each retry
regenerates exactly the records whose standing answer is of its kind (counted from the store:
the retry round's own outputs), the run's original outputs stay byte for byte, and export and
report take each record's newest accepted answer and agree on the counts.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import orjson
import pytest
import redis

from genfleet.common import keys
from genfleet.common.manifest import Manifest
from genfleet.common.records import decode_jsonl_gz
from genfleet.common.settings import Settings
from genfleet.common.store import Store, open_store
from genfleet.producer.report import build_report
from genfleet.producer.runs.lifecycle import delete_run
from genfleet.producer.runs.retries import retry_records
from genfleet.producer.tries import read_rounds, retry_kind
from harness.env import base_env, free_port
from harness.processes import Worker
from harness.runs import export_rows, stage, wait_run_ended
from harness.sources import lines

pytestmark = [pytest.mark.integration, pytest.mark.slow]

PROMPTS = 120
MAX_TOKENS = 2500


def outputs_of(store: Store, run: str) -> dict[str, bytes]:
    found: dict[str, bytes] = {}
    for key in store.list(keys.outputs_prefix(run)):
        data = store.get(key)
        assert data is not None
        found[key] = data
    return found


def records_of(store: Store, run: str) -> dict[tuple[str, int], dict[str, Any]]:
    """Every record of `run`'s output objects, read from the store itself."""
    found: dict[tuple[str, int], dict[str, Any]] = {}
    for data in outputs_of(store, run).values():
        for record in decode_jsonl_gz(data):
            found[(record["id"], record.get("sample", 0))] = record
    return found


def standing(rows: list[dict[str, Any]], kind: str) -> set[tuple[str, int]]:
    return {(r["id"], r.get("sample", 0)) for r in rows if retry_kind(r) == kind}


def test_retry_regenerates_exactly_the_chosen_records_and_overwrites_nothing(
    tmp_path: Path,
    redis_url: str,
    redis_client: redis.Redis,
    start_worker: Callable[..., Worker],
) -> None:
    texts = {
        f"q{n:04d}": f"Question {n}: explain the number {n} at length." for n in range(PROMPTS)
    }
    source = lines(tmp_path / "prompts.jsonl", [{"id": i, "prompt": t} for i, t in texts.items()])
    store_url = (tmp_path / "store").as_uri()
    emulator = {
        "emulator_loop_rate": 0.2,
        "emulator_mean_completion_tokens": 1000,
        "emulator_max_completion_tokens": 4096,
        "max_tokens": MAX_TOKENS,
        "batch_size": 40,
    }
    faulty = start_worker(
        base_env(
            redis_url,
            store_url,
            emulator_abort_rate=0.15,
            request_retries=0,
            port=free_port(),
            **emulator,
        )
    )
    settings = Settings(
        redis_url=redis_url,
        store=store_url,
        batch_size=40,
        max_tokens=MAX_TOKENS,
        quality_gate=False,
    )
    stage(settings, "r", source)
    faulty.wait_ready()
    assert wait_run_ended(settings, redis_client, "r", 180)["state"] == "done"
    faulty.stop()
    store = open_store(store_url)
    originals = outputs_of(store, "r")
    first = records_of(store, "r")
    kinds = {
        kind: {k for k, r in first.items() if retry_kind(r) == kind}
        for kind in ("errors", "stopped", "cut")
    }
    assert all(kinds.values()), {k: len(v) for k, v in kinds.items()}  # the run holds each kind

    # The answers of retries come from a worker that aborts nothing.
    healthy = start_worker(base_env(redis_url, store_url, port=free_port(), **emulator))
    healthy.wait_ready()

    # 1. errors: exactly the error records go again, and are answered now
    found = retry_records(settings, "r", {"errors"})
    assert (found.round, found.records) == (1, len(kinds["errors"]))
    assert wait_run_ended(settings, redis_client, found.retry_run, 120)["state"] == "done"
    first_try = records_of(store, found.retry_run)
    assert set(first_try) == kinds["errors"]
    result, rows = export_rows(settings, "r", tmp_path / "1.jsonl")
    assert len(rows) == PROMPTS and result.errors == 0
    assert result.retried == result.retried_replaced == len(kinds["errors"])
    tried = {(r["id"], 0): r for r in rows if r.get("try") == 1}
    assert set(tried) == kinds["errors"]
    assert all(
        r["run"] == "r" and r["tried_in"].startswith(found.retry_run) for r in tried.values()
    )

    # 2. stopped, the guard off: the loops run on (to max_tokens), recorded for the round
    stopped_before = standing(rows, "stopped")  # the first's, and round 1's new loops
    assert stopped_before == kinds["stopped"] | {
        k for k, r in first_try.items() if retry_kind(r) == "stopped"
    }
    found = retry_records(settings, "r", {"stopped"}, repetition_guard=False)
    assert (found.round, found.records) == (2, len(stopped_before))
    assert wait_run_ended(settings, redis_client, found.retry_run, 120)["state"] == "done"
    second = records_of(store, found.retry_run)
    assert set(second) == stopped_before
    assert all(r["finish_reason"] != "repetition" for r in second.values())
    child = Manifest.load(store, found.retry_run)
    assert child is not None and child.params.repetition_guard is False
    assert [r.params for r in read_rounds(store, "r")] == [{}, {"repetition_guard": False}]

    # 3. cut, with a larger budget: the standing cut answers (some are round 2's) go again
    _, rows = export_rows(settings, "r", tmp_path / "2.jsonl")
    cut_before = standing(rows, "cut")
    assert cut_before >= kinds["cut"] and cut_before & stopped_before
    found = retry_records(settings, "r", {"cut"}, max_tokens=4096)
    assert (found.round, found.records) == (3, len(cut_before))
    assert wait_run_ended(settings, redis_client, found.retry_run, 180)["state"] == "done"
    third = records_of(store, found.retry_run)
    assert set(third) == cut_before
    assert {r["usage"]["completion_tokens"] for r in third.values()} - set(range(MAX_TOKENS + 1))

    # nothing overwritten; export and report agree on the standing answers
    assert outputs_of(store, "r") == originals
    result, rows = export_rows(settings, "r", tmp_path / "3.jsonl", with_stopped=True)
    report = build_report(settings, "r")
    assert len(rows) == report["records"] == PROMPTS
    retried = kinds["errors"] | stopped_before | cut_before
    assert result.retried == report["retried"] == len(retried)
    assert result.retried_replaced == report["retried_replaced"]
    assert result.retried_kept == report["retried_kept"] > 0
    assert (result.cut, result.stopped, result.errors) == (
        report["length_capped"],
        report["stopped"],
        report["errors"],
    )
    by_key = {(r["id"], 0): r for r in rows}
    for key, record in third.items():  # the newest try stands where it is an answer
        if not record.get("error"):
            assert by_key[key]["try"] == 3
            assert by_key[key]["content"] == record["content"]
    assert all("try" not in by_key[k] for k in set(by_key) - retried)
    for key in set(by_key) - retried:
        assert orjson.dumps(by_key[key]) == orjson.dumps(first[key])

    # a retry asks the run's own model: another is refused, nothing written
    other = Settings(
        redis_url=redis_url, store=store_url, model="/models/other", quality_gate=False
    )
    with pytest.raises(Exception, match="model"):
        retry_records(other, "r", {"cut"})
    assert len(read_rounds(store, "r")) == 3

    # deleting the run deletes its rounds' runs
    delete_run(settings, store, redis_client, "r")
    assert not list(store.list("r"))
