"""One batch in process, on the fakes (tests/fakes/): the core tests of the task and the batch."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import orjson

from genfleet.common import keys
from genfleet.common.ledger import running_field
from genfleet.common.records import (
    GenerationParams,
    PromptRecord,
    WorkOrder,
    decode_jsonl_gz,
    encode_jsonl_gz,
)
from genfleet.common.store import Store
from genfleet.workers.batch import BatchSummary, execute
from genfleet.workers.feeding.feeder import Feeder
from tests.fakes.memory_redis import MemoryRedis
from tests.fakes.runtime import FakeRuntime

PARAMS = GenerationParams(max_tokens=16, temperature=0.0, top_p=1.0, thinking=False)
# a reasoning model's sampling, as the engine client's tests send it
THINKING_PARAMS = GenerationParams(max_tokens=64, temperature=0.6, top_p=0.95, thinking=True)
RUN, BATCH = "r", "batch-000000"
MakeFeeder = Callable[..., Feeder]  # the `feeders` fixture (tests/workers/conftest.py)
MakeRuntime = Callable[..., FakeRuntime]  # the `make_runtime` fixture
# the reaper's clock in the core tests, and the lease it reads
NOW = 1_700_000_000.0
TTL_S = 10.0


def core_order(batch: str = BATCH, prompts: int = 5, run: str = RUN) -> WorkOrder:
    """The work order of `batch` of `run` on the emulator queue, its input at the usual key."""
    return WorkOrder(
        run=run,
        batch=batch,
        key=keys.input_key(run, batch),
        params=PARAMS,
        model="emulator",
        engine="emulator",
        prompts=prompts,
    )


def stage_batch(store: Store, count: int, data: bytes | None = None) -> WorkOrder:
    """BATCH's input object (`count` prompts p0… asking q0…, or `data` as it is) and its order."""
    records = [
        PromptRecord(id=f"p{i}", messages=[{"role": "user", "content": f"q{i}"}])
        for i in range(count)
    ]
    order = core_order(prompts=count)
    store.put(order.key, encode_jsonl_gz(r.to_json() for r in records) if data is None else data)
    return order


def stage_task(runtime: FakeRuntime, count: int, data: bytes | None = None) -> dict[str, Any]:
    """What `generate_batch` is sent for BATCH, staged as enqueue leaves it (input, queued)."""
    order = stage_batch(runtime.store, count, data)
    runtime.redis.sadd(keys.queued_key(RUN), BATCH)
    return order.model_dump(mode="json")


def batch_state(db: MemoryRedis) -> dict[str, Any]:
    """What Redis says about BATCH after the task: running, tries, failed, queued."""
    return {
        "running": db.hget(keys.running_key(), running_field(RUN, BATCH)) is not None,
        "attempts": int(db.hget(keys.attempts_key(RUN), BATCH) or 0),
        "failed": (db.hget(keys.failed_key(RUN), BATCH) or b"").decode().split(":")[0] or None,
        "queued": BATCH.encode() in db.smembers(keys.queued_key(RUN)),
    }


def running_order(db: MemoryRedis, batch: str, claimed_at: float) -> dict[str, Any]:
    """`batch` claimed at `claimed_at` (its running entry, no lease yet); returns its order."""
    order = core_order(batch).model_dump(mode="json")
    db.hset(
        keys.running_key(),
        running_field(RUN, batch),
        orjson.dumps({**order, "claimed_at": claimed_at}),
    )
    return order


def execute_batch(
    order: WorkOrder,
    store: Store,
    db: MemoryRedis,
    feeder: Feeder,
    lease_ttl_s: float = 30,
    checkpoint_interval_s: float = 60,
) -> BatchSummary:
    """`batch.execute` of `order` by worker `w@test`."""
    return execute(
        order,
        store=store,
        client=db,
        feeder=feeder,
        worker="w@test",
        lease_ttl_s=lease_ttl_s,
        checkpoint_interval_s=checkpoint_interval_s,
    )


def output_rows(store: Store) -> list[dict[str, Any]]:
    """BATCH's output records, [] while it has no output object."""
    return list(decode_jsonl_gz(store.get(keys.output_key(RUN, BATCH)) or b""))
