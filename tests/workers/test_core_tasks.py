"""The generate task's error mapping and the lease reaper, in process, on the fakes.

`generate_batch` is called as a plain function (no broker, no eager mode) with a worker
runtime of fakes in place of the real one: a real Feeder over FakeChat, a MemoryStore, a
MemoryRedis. Called directly, Celery's `retry` re-raises the original error, so "retried"
shows as that error with the try counted and nothing failed; "requeued" is a `Reject` with
requeue; "failed" is `BatchFailed` with the batch in the run's failed set.
"""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import orjson
import pytest
import redis
from celery.exceptions import Reject

from genfleet.common import keys, model_identity
from genfleet.common.errors import EngineBusy, EngineConfigError, EngineDown, RequestFailed
from genfleet.common.ledger import Ledger, running_field, work_order_of
from genfleet.common.records import (
    PromptRecord,
    WorkOrder,
    decode_jsonl_gz,
    encode_jsonl_gz,
)
from genfleet.common.routing import ModelRef
from genfleet.common.settings import Settings
from genfleet.producer.runs.identity import claim_run
from genfleet.workers.control.reaper import reap
from genfleet.workers.engine.families import choose
from genfleet.workers.engine.fingerprint import checkpoint_identity
from genfleet.workers.tasks import BatchFailed, generate_batch
from harness.waits import meanwhile, wait_for
from tests.fakes.engine import FakeChat
from tests.fakes.memory_redis import MemoryRedis
from tests.fakes.memory_store import MemoryStore
from tests.support.core import (
    BATCH,
    NOW,
    PARAMS,
    RUN,
    TTL_S,
    MakeRuntime,
    batch_state,
    core_order,
    running_order,
    stage_task,
)


def test_a_batch_that_succeeds_returns_its_summary_and_leaves_no_trace(
    make_runtime: MakeRuntime,
) -> None:
    runtime = make_runtime(FakeChat())
    order = stage_task(runtime, 3)

    result = generate_batch(order)

    assert (result["run"], result["batch"], result["completions"]) == (RUN, BATCH, 3)
    assert result["worker"] == "w@test"
    assert [s.batch for s in runtime.finished] == [BATCH]
    assert batch_state(runtime.redis) == {
        "running": False,
        "attempts": 0,
        "failed": None,
        "queued": False,
    }


def test_engine_down_is_retried_until_the_budget_then_failed(
    make_runtime: MakeRuntime,
) -> None:
    runtime = make_runtime(FakeChat(failures={"p0": [EngineDown("engine gone")] * 3}), 2)
    order = stage_task(runtime, 2)

    for attempt in (1, 2):
        with pytest.raises(EngineDown):  # `retry` called directly re-raises the error
            generate_batch(order)
        assert batch_state(runtime.redis) == {
            "running": False,
            "attempts": attempt,
            "failed": None,
            "queued": True,
        }
    with pytest.raises(BatchFailed, match="failed 3 times"):
        generate_batch(order)
    assert batch_state(runtime.redis) == {
        "running": False,
        "attempts": 3,
        "failed": "EngineDown",
        "queued": False,
    }
    assert not runtime.store.exists(keys.output_key(RUN, BATCH))


def test_a_retry_after_the_engine_came_back_succeeds(
    make_runtime: MakeRuntime,
) -> None:
    runtime = make_runtime(FakeChat(failures={"p1": [EngineDown("engine gone")]}), 2)
    order = stage_task(runtime, 3)
    with pytest.raises(EngineDown):
        generate_batch(order)

    result = generate_batch(order)

    assert result["completions"] == 3 and result["resumed"] >= 1  # p0 came from a part
    assert (
        batch_state(runtime.redis)["failed"] is None and not batch_state(runtime.redis)["running"]
    )


def test_a_missing_input_fails_at_once(make_runtime: MakeRuntime) -> None:
    runtime = make_runtime(FakeChat())
    order = stage_task(runtime, 2)
    runtime.store.delete_prefix(order["key"])

    with pytest.raises(BatchFailed, match="missing"):
        generate_batch(order)

    assert batch_state(runtime.redis) == {
        "running": False,
        "attempts": 0,
        "failed": "BatchInputMissing",
        "queued": False,
    }


def test_an_unforeseen_error_parks_the_batch_in_the_failed_set(
    make_runtime: MakeRuntime,
) -> None:
    runtime = make_runtime(FakeChat())
    order = stage_task(runtime, 2, data=b"not gzip at all")  # a corrupt staged input

    with pytest.raises(BatchFailed, match="BadGzipFile"):
        generate_batch(order)

    assert batch_state(runtime.redis) == {
        "running": False,
        "attempts": 0,
        "failed": "BadGzipFile",
        "queued": False,
    }


def test_a_shutdown_requeues_the_batch_without_counting_a_try(
    make_runtime: MakeRuntime,
) -> None:
    gate = threading.Event()
    chat = FakeChat(gate=gate, ungated={"p0"})
    runtime = make_runtime(chat)
    order = stage_task(runtime, 4)

    shut_down = meanwhile(
        lambda: chat.inflight == 3, runtime.feeder.cancel_all, "three requests in flight"
    )
    with pytest.raises(Reject) as caught:
        generate_batch(order)
    shut_down()
    gate.set()

    assert caught.value.requeue
    assert batch_state(runtime.redis) == {
        "running": False,
        "attempts": 0,
        "failed": None,
        "queued": True,
    }
    assert list(runtime.store.list(keys.parts_prefix(RUN, BATCH)))  # p0 is checkpointed


# --- the reaper ------------------------------------------------------------------------------


def test_a_batch_stamps_its_times_by_redis_clock_not_the_workers(make_runtime: MakeRuntime) -> None:
    # The reaper compares a claim's time with its own pass's, both by Redis's clock: a worker
    # whose host clock runs ten minutes ahead stamped its claims ten minutes into the future,
    # and the reaper then left its batches alone ten minutes after it fell silent.
    gate = threading.Event()
    chat = FakeChat(gate=gate)
    runtime = make_runtime(chat)
    runtime.redis.time = lambda: (1_000, 500_000)  # type: ignore[method-assign]
    order = stage_task(runtime, 2)
    field = running_field(RUN, BATCH)

    claims: list[float] = []

    def read_claim() -> None:  # then let the batch finish
        claims.append(orjson.loads(runtime.redis.hget(keys.running_key(), field))["claimed_at"])
        gate.set()

    claimed = meanwhile(
        lambda: runtime.redis.hget(keys.running_key(), field), read_claim, "the batch's claim"
    )
    generate_batch(order)
    claimed()

    assert claims == [1_000.5]
    # So are the run's start, its last batch's end and its tok/s bucket, which `status`
    # compares with its own "now" and with each other.
    counted = runtime.redis.hgetall(keys.counters_key(RUN))
    assert (counted[b"started_at"], counted[b"last_done_at"]) == (b"1000.5", b"1000.5")
    assert runtime.redis.hget(keys.throughput_bucket_key(RUN, 100), "")


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_the_reaper_requeues_only_batches_whose_worker_vanished() -> None:
    clock = Clock()
    db, store = MemoryRedis(clock), MemoryStore()
    running_order(db, "batch-000001", NOW - 100)
    db.set(keys.lease_key(RUN, "batch-000001"), "w1", px=int(TTL_S * 1000))
    running_order(
        db, "batch-000002", NOW - 1
    )  # just claimed: its first lease may not be written yet
    running_order(db, "batch-000003", NOW - 100)  # lease lapsed, output written: it finished
    store.put_if_absent(keys.output_key(RUN, "batch-000003"), b"done")
    lost = running_order(db, "batch-000004", NOW - 100)  # lease lapsed, no output: lost
    db.set(keys.lease_key(RUN, "batch-000004"), "w2", px=int(TTL_S * 1000))
    clock.now = TTL_S + 1  # w2 stopped refreshing its lease; w1 refreshes:
    db.set(keys.lease_key(RUN, "batch-000001"), "w1", px=int(TTL_S * 1000))
    requeued: list[dict[str, Any]] = []

    # A first look at a lapsed lease takes nothing: a live worker whose lease lapsed while
    # Redis was away re-sets it within a heartbeat. Half a lease on, it is a death.
    first = reap(db, store, TTL_S, NOW - TTL_S / 2, requeued.append)
    assert (requeued, first["requeued"]) == ([], [])
    report = reap(db, store, TTL_S, NOW, requeued.append)

    assert requeued == [lost]
    WorkOrder.model_validate(requeued[0])  # a valid work order, without claimed_at
    assert report["requeued"] == [running_field(RUN, "batch-000004")]
    assert report["finished"] == [running_field(RUN, "batch-000003")]
    left = {k.decode() for k in db.hgetall(keys.running_key())}
    assert left == {running_field(RUN, "batch-000001"), running_field(RUN, "batch-000002")}

    again: list[dict[str, Any]] = []
    reap(db, store, TTL_S, NOW + 1, again.append)
    assert again == []  # requeued once, not once per pass


def test_an_order_of_a_cancelled_run_is_parked_not_generated(
    make_runtime: MakeRuntime,
) -> None:
    chat = FakeChat()
    runtime = make_runtime(chat)
    order = stage_task(runtime, 3)
    runtime.redis.set(keys.cancelled_key(RUN), b"1")

    assert generate_batch(order)["park"] is True
    assert sum(chat.calls.values()) == 0
    assert batch_state(runtime.redis) == {
        "running": False,
        "attempts": 0,
        "failed": None,
        "queued": False,
    }
    assert not runtime.store.exists(keys.output_key(RUN, BATCH))


def test_an_order_of_a_deleted_run_is_dropped(make_runtime: MakeRuntime) -> None:
    chat = FakeChat()
    runtime = make_runtime(chat)
    order = {**stage_task(runtime, 3), "enqueued_at": 100.0}
    runtime.redis.set(keys.deleted_key(RUN), b"200.0")  # deleted after the order was sent

    assert generate_batch(order)["drop"] is True
    assert sum(chat.calls.values()) == 0
    assert not runtime.store.exists(keys.output_key(RUN, BATCH))


def test_cancelling_a_running_batch_checkpoints_what_finished_and_parks_it(
    make_runtime: MakeRuntime,
) -> None:
    chat = FakeChat(gate=threading.Event(), ungated={"p0"})  # p0 answers, the rest wait
    runtime = make_runtime(chat)
    order = stage_task(runtime, 3)
    done: list[dict[str, Any]] = []
    worker = threading.Thread(target=lambda: done.append(generate_batch(order)))
    worker.start()
    wait_for(lambda: chat.calls["p0"] == 1 and chat.inflight == 2, 10, "p0 done, two waiting")
    runtime.redis.set(keys.cancelled_key(RUN), b"1")
    worker.join(timeout=15)

    assert not worker.is_alive()
    assert done[0]["cancelled"] is True
    parts = list(runtime.store.list(keys.parts_prefix(RUN, BATCH)))
    rows = [row for key in parts for row in decode_jsonl_gz(runtime.store.get(key) or b"")]
    assert [row["id"] for row in rows] == ["p0"]
    assert not runtime.store.exists(keys.output_key(RUN, BATCH))
    assert batch_state(runtime.redis) == {
        "running": False,
        "attempts": 0,
        "failed": None,
        "queued": False,
    }
    assert runtime.redis.exists(keys.lease_key(RUN, BATCH)) == 0


def test_an_engine_refusing_the_worker_hands_the_order_back_without_a_try(
    make_runtime: MakeRuntime,
) -> None:
    refusal = EngineConfigError("engine answered 401: Unauthorized")
    runtime = make_runtime(FakeChat(failures={"p0": [refusal], "p1": [refusal]}))
    order = stage_task(runtime, 2)

    with pytest.raises(Reject) as caught:
        generate_batch(order)

    assert caught.value.requeue is True
    assert batch_state(runtime.redis) == {
        "running": False,
        "attempts": 0,
        "failed": None,
        "queued": True,
    }
    assert len(runtime.refused) == 1 and "401" in runtime.refused[0]


def test_backpressure_and_a_failing_prompt_never_fail_the_batch(
    make_runtime: MakeRuntime,
) -> None:
    busy = [EngineBusy("engine answered 429: slow down", retry_after_s=0.0)] * 3
    failed = RequestFailed(500, "InternalError", "engine answered 500: boom")
    chat = FakeChat(failures={"p0": busy, "p1": busy, "p3": [failed]})
    runtime = make_runtime(chat)  # retries=0: the first failed try is the last
    order = stage_task(runtime, 4)

    result = generate_batch(order)

    assert (result["completions"], result["errors"]) == (3, 1)
    assert chat.calls["p0"] == chat.calls["p1"] == 4  # three 429s, then the answer
    # p3 failed right after p2 succeeded: p2 sent again (the canary) said the engine serves
    assert chat.calls["p2"] == 2
    assert batch_state(runtime.redis) == {
        "running": False,
        "attempts": 0,
        "failed": None,
        "queued": False,
    }


def test_the_reaper_spares_a_lease_re_set_after_its_first_look() -> None:
    """A blip longer than the lease: every lease lapsed while Redis was away; the live
    worker's heartbeat re-sets its lease before the reaper's second look, so nothing is
    re-enqueued (it would run twice)."""
    db, store = MemoryRedis(), MemoryStore()
    running_order(db, "batch-000001", NOW - 100)
    requeued: list[dict[str, Any]] = []
    reap(db, store, TTL_S, NOW - TTL_S, requeued.append)  # the lease lapsed: first look
    db.set(keys.lease_key(RUN, "batch-000001"), "w1", px=int(TTL_S * 1000))  # the heartbeat
    reap(db, store, TTL_S, NOW, requeued.append)
    db.delete(keys.lease_key(RUN, "batch-000001"))  # later its worker dies
    reap(db, store, TTL_S, NOW + 1, requeued.append)  # a fresh first look
    assert requeued == []
    reap(db, store, TTL_S, NOW + 1 + TTL_S / 2, requeued.append)
    assert len(requeued) == 1


def test_an_order_naming_another_runs_input_is_refused_not_generated(
    make_runtime: MakeRuntime,
) -> None:
    chat = FakeChat()
    runtime = make_runtime(chat)
    order = stage_task(runtime, 3)
    # Run "b"'s prompts, and an order of run "r" that names them (anyone who can send a task
    # can write one): r's output must never be built from b's prompts.
    foreign = keys.input_key("b", BATCH)
    runtime.store.put(foreign, runtime.store.get(keys.input_key(RUN, BATCH)) or b"")
    runtime.store.delete_prefix(keys.input_key(RUN, BATCH))

    with pytest.raises(ValueError, match="is not the staged input"):
        generate_batch({**order, "key": foreign})
    assert sum(chat.calls.values()) == 0
    assert not runtime.store.exists(keys.output_key(RUN, BATCH))
    assert WorkOrder.model_validate({**order, "key": ""}).key == keys.input_key(RUN, BATCH)


def test_an_order_of_a_deleted_staging_is_dropped_whatever_the_clocks_say(
    make_runtime: MakeRuntime,
) -> None:
    chat = FakeChat()
    runtime = make_runtime(chat)
    # The producer's clock runs an hour ahead of the host that deleted the run.
    order = {**stage_task(runtime, 3), "enqueued_at": 1_700_003_600.0, "staging": "s-old"}
    runtime.redis.set(keys.deleted_key(RUN), b"s-old")

    assert generate_batch(order)["drop"] is True
    assert sum(chat.calls.values()) == 0
    assert not runtime.store.exists(keys.output_key(RUN, BATCH))


def test_an_order_of_a_superseded_staging_is_dropped_and_leaves_the_new_ones_state(
    make_runtime: MakeRuntime,
) -> None:
    chat = FakeChat()
    runtime = make_runtime(chat)
    order = {**stage_task(runtime, 3), "staging": "s-old"}
    staging = claim_run(
        runtime.store, RUN, PARAMS, ModelRef("emulator", "emulator"), {}, "f", "src"
    )
    assert staging != "s-old"  # the run was staged anew: its own order is queued, and runs
    Ledger(runtime.redis).claim({**order, "staging": staging}, "other@w", 1_700_000_000.0)

    result = generate_batch(order)

    assert result["superseded"] is True
    assert sum(chat.calls.values()) == 0
    assert not runtime.store.exists(keys.output_key(RUN, BATCH))
    assert batch_state(runtime.redis) == {
        "running": True,
        "attempts": 0,
        "failed": None,
        "queued": True,
    }
    entry = orjson.loads(runtime.redis.hget(keys.running_key(), f"{RUN}/{BATCH}") or b"{}")
    assert entry["worker"] == "other@w"  # the new staging's running entry is untouched


def identity(**settings: Any) -> dict[str, Any]:
    """The model identity a worker with these settings computes at start."""
    chosen = Settings(**settings)
    return checkpoint_identity(chosen, choose(chosen, None))


@pytest.mark.integration
def test_a_worker_serving_another_model_hands_that_runs_orders_back_and_takes_others(
    make_runtime: MakeRuntime, redis_client: redis.Redis
) -> None:
    chat = FakeChat()
    runtime = make_runtime(chat)  # the emulator with another reasoning parser
    runtime.model_identity = identity(reasoning_parser="deepseek-r1")
    runtime.settings = runtime.settings.model_copy(update={"refused_order_rest_s": 0.0})
    model_identity.record(runtime.store, RUN, model_identity.asked(Settings()))  # at staging
    order = stage_task(runtime, 3)

    result = generate_batch(order)

    # A copy at the end of the run's queue (the real broker), for another worker; this
    # delivery acked. Not generated, not failed, no try spent, nothing claimed.
    assert (result["handed_back"], result["queue"]) == (True, "gpu.emulator")
    assert [work_order_of(m) for m in redis_client.lrange("gpu.emulator", 0, -1)] == [(RUN, BATCH)]
    assert sum(chat.calls.values()) == 0
    assert not runtime.store.exists(keys.output_key(RUN, BATCH))
    assert runtime.refused == []  # the worker goes on consuming
    assert batch_state(runtime.redis) == {
        "running": False,
        "attempts": 0,
        "failed": None,
        "queued": True,
    }
    [finding] = runtime.findings
    assert (finding["cause"], finding["run"], finding["worker"]) == (
        "model_mismatch",
        RUN,
        "w@test",
    )
    differences = finding["numbers"]["differences"]
    assert [d.split(":")[0] for d in differences] == ["reasoning_parser"]
    assert differences[0] in result["refused"]
    noted = model_identity.refusals(runtime.redis, RUN)
    assert list(noted) == ["w@test"] and noted["w@test"]["differences"] == differences

    assert generate_batch(order)["handed_back"]  # remembered: handed back again, judged once
    assert len(runtime.findings) == 1 and redis_client.llen("gpu.emulator") == 2

    other = core_order(run="r2", prompts=2)  # a run staged for this worker's model
    model_identity.record(
        runtime.store, "r2", model_identity.asked(Settings(reasoning_parser="deepseek-r1"))
    )
    records = [
        PromptRecord(id=f"p{i}", messages=[{"role": "user", "content": "q"}]) for i in (0, 1)
    ]
    runtime.store.put(other.key, encode_jsonl_gz(r.to_json() for r in records))
    assert generate_batch(other.model_dump(mode="json"))["completions"] == 2


def test_no_thinking_on_a_model_without_a_switch_is_refused_not_ignored(
    make_runtime: MakeRuntime,
) -> None:
    chat = FakeChat()
    runtime = make_runtime(chat)
    runtime.model_identity = identity(thinking_switch="none")
    no_thinking = PARAMS.model_dump()  # PARAMS asks for no thinking

    with pytest.raises(BatchFailed, match="no thinking switch"):
        generate_batch({**stage_task(runtime, 2), "params": no_thinking})

    assert sum(chat.calls.values()) == 0
    assert batch_state(runtime.redis)["failed"] == "ThinkingUnsupported"
    with pytest.raises(ValueError, match="--no-thinking needs a thinking switch"):
        Settings(thinking=False, thinking_switch="none")  # and refused where it is given


def test_the_checkpoint_fingerprint_follows_config_weights_and_quantization(
    tmp_path: Path,
) -> None:
    (tmp_path / "config.json").write_text('{"architectures": ["Qwen3ForCausalLM"]}')
    (tmp_path / "model.safetensors.index.json").write_text('{"weight_map": {"a": "1"}}')
    base = identity(model=str(tmp_path))
    assert base["config_sha256"] and base["weights_index_sha256"]
    (tmp_path / "model.safetensors.index.json").write_text('{"weight_map": {"a": "2"}}')
    reweighted = identity(model=str(tmp_path))
    (tmp_path / "config.json").write_text(
        '{"architectures": ["Qwen3ForCausalLM"], "quantization_config": {"quant_method": "fp8"}}'
    )
    quantized = identity(model=str(tmp_path))
    fingerprints = {base["fingerprint"], reweighted["fingerprint"], quantized["fingerprint"]}
    assert len(fingerprints) == 3 and quantized["quantization"] == "fp8"
    assert (
        identity(model=str(tmp_path), engine_extra_args="--quantization awq")["quantization"]
        == "awq"
    )


def test_an_order_read_as_cancelled_is_generated_when_the_run_was_resumed_before_it_parked(
    make_runtime: MakeRuntime, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The worker read the flag; `enqueue --resume` deleted it and listed the order as
    # outstanding before the worker parked it. Parking it now would leave the batch with no
    # order and no state any reconciler reads.
    chat = FakeChat()
    runtime = make_runtime(chat)
    order = stage_task(runtime, 3)
    monkeypatch.setattr("genfleet.workers.admission.is_cancelled", lambda client, run: True)

    result = generate_batch(order)

    assert result["completions"] == 3
    assert runtime.store.exists(keys.output_key(RUN, BATCH))


def test_a_running_batch_stopped_by_a_cancel_the_resume_undid_is_requeued_not_parked(
    make_runtime: MakeRuntime, monkeypatch: pytest.MonkeyPatch
) -> None:
    chat = FakeChat(gate=threading.Event(), ungated={"p0"})  # p0 answers, the rest wait
    runtime = make_runtime(chat)
    order = stage_task(runtime, 3)
    seen = threading.Event()
    monkeypatch.setattr(
        "genfleet.workers.tasks.is_cancelled", lambda client, run: seen.is_set()
    )  # the batch saw the flag; the resume deleted it before the park
    raised: list[BaseException] = []

    def run() -> None:
        try:
            generate_batch(order)
        except BaseException as exc:  # noqa: BLE001 - the test looks at it
            raised.append(exc)

    worker = threading.Thread(target=run)
    worker.start()
    wait_for(lambda: chat.calls["p0"] == 1 and chat.inflight == 2, 10, "p0 done, two waiting")
    seen.set()
    worker.join(timeout=15)

    assert not worker.is_alive()
    assert len(raised) == 1 and isinstance(raised[0], Reject) and raised[0].requeue is True
    assert batch_state(runtime.redis) == {
        "running": False,
        "attempts": 0,
        "failed": None,
        "queued": True,  # the resume's order: outstanding, the message back in the queue
    }
    assert list(runtime.store.list(keys.parts_prefix(RUN, BATCH)))  # p0 kept for the next try


def test_a_staging_superseded_while_its_batch_ran_leaves_the_new_stagings_claim(
    make_runtime: MakeRuntime,
) -> None:
    chat = FakeChat(gate=threading.Event())
    runtime = make_runtime(chat)
    old = claim_run(runtime.store, RUN, PARAMS, ModelRef("emulator", "emulator"), {}, "f", "src")
    order = {**stage_task(runtime, 2), "staging": old}
    done: list[dict[str, Any]] = []
    worker = threading.Thread(target=lambda: done.append(generate_batch(order)))
    worker.start()
    wait_for(lambda: chat.inflight == 2, 10, "both prompts sent")
    # Deleted and staged anew under the same name; the new staging's batch runs elsewhere.
    runtime.store.delete_prefix(keys.claim_key(RUN))
    new = claim_run(runtime.store, RUN, PARAMS, ModelRef("emulator", "emulator"), {}, "g", "src")
    assert new != old
    Ledger(runtime.redis).claim({**order, "staging": new}, "other@w", NOW)
    chat.gate.set()
    worker.join(timeout=15)

    assert done and done[0]["superseded"] is True
    assert not runtime.store.exists(keys.output_key(RUN, BATCH))
    entry = orjson.loads(runtime.redis.hget(keys.running_key(), f"{RUN}/{BATCH}") or b"{}")
    assert entry.get("worker") == "other@w"  # the reaper still sees the new staging's batch
