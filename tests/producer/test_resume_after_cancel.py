"""`enqueue --resume` right after `cancel`: a worker parking one of the run's orders at the
moment the resume reads what is outstanding never leaves that batch without an order."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import orjson
import pytest
import redis

from genfleet.common import keys
from genfleet.common.ledger import Ledger
from genfleet.common.settings import Settings
from genfleet.producer import broker
from genfleet.producer.enqueue import enqueue_run, reader_options

pytestmark = pytest.mark.integration

RUN = "gap"
PARKED = "batch-000001"


def test_an_order_parked_while_the_resume_lists_the_outstanding_ones_is_not_lost(
    tmp_path: Path, redis_url: str, redis_client: redis.Redis, monkeypatch: pytest.MonkeyPatch
) -> None:
    settings = Settings(redis_url=redis_url, store=(tmp_path / "store").as_uri(), batch_size=10)
    source = tmp_path / "p.jsonl"
    source.write_bytes(b"".join(orjson.dumps({"prompt": f"q{i}"}) + b"\n" for i in range(50)))
    options = reader_options(settings)
    assert enqueue_run(settings, RUN, str(source), options).batches_enqueued == 5
    redis_client.set(keys.cancelled_key(RUN), "1")  # `genfleet cancel`
    listed = broker.orders_in_broker
    parked: list[bool] = []

    def list_then_park(client: Any, queue: str, run: str) -> set[str]:
        outstanding = listed(client, queue, run)
        # A worker takes PARKED's message now and parks it, as admission does for a run it
        # reads as cancelled (its message acked: the broker no longer holds it).
        parked.append(Ledger(redis_client).park(RUN, PARKED))
        return outstanding

    monkeypatch.setattr(broker, "orders_in_broker", list_then_park)

    result = enqueue_run(settings, RUN, None, options, verify=True)

    assert result.uncancelled is True
    queued = Ledger(redis_client).queued(RUN)
    # Either the park came too late (the run was resumed: the worker generates the order it
    # holds) or it came first and this resume sent the order again: never neither.
    assert parked == [False] or result.batches_enqueued == 1
    assert PARKED in queued and len(queued) == 5
