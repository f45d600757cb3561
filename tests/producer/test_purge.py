"""Purging a run's waiting work orders: real Celery messages in real Redis lists.

`cancel` and `delete` remove a run's orders from its queue in one pass (common to a queue of
any length), never one LREM per message: checked here is that exactly the run's orders go,
every other message stays, in its order, and nothing else is left behind.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import redis
from pydantic import SecretStr

from genfleet.common import keys
from genfleet.common.ledger import work_order_of
from genfleet.common.records import WorkOrder
from genfleet.common.settings import Settings
from genfleet.producer.broker import make_client_app, purge_orders, send_orders
from harness.env import free_port
from harness.services import RedisServer
from tests.support.core import core_order

pytestmark = pytest.mark.integration

QUEUE = "gpu.emulator"


def order(run: str, index: int) -> WorkOrder:
    return core_order(keys.batch_id(index), prompts=1, run=run)


def waiting(client: redis.Redis) -> list[tuple[str, str] | None]:
    return [work_order_of(raw) for raw in client.lrange(QUEUE, 0, -1)]


@pytest.fixture
def private_redis(tmp_path: Path) -> Iterator[RedisServer]:
    """A server of its own: its command counts are this test's alone."""
    server = RedisServer(tmp_path, free_port(), "purge-test")
    server.start()
    try:
        yield server
    finally:
        server.kill()


def test_a_purge_removes_exactly_the_runs_orders_and_keeps_the_rest_in_order(
    private_redis: RedisServer,
) -> None:
    settings = Settings(redis_url=SecretStr(private_redis.url))
    redis_client = private_redis.client()
    app = make_client_app(settings)
    try:
        # Interleaved, and "a.b" starts with "a.": only run "a" goes.
        mixed = [order(run, i) for i in range(700) for run in ("a", "a.b", "c") if i % 3 != 2]
        send_orders(app, settings, mixed)
    finally:
        app.close()
    redis_client.lpush(QUEUE, b"not a work order")
    before = waiting(redis_client)

    redis_client.config_resetstat()
    removed = purge_orders(redis_client, QUEUE, "a")
    calls = redis_client.info("commandstats")

    assert removed == {keys.batch_id(i) for i in range(700) if i % 3 != 2}
    assert waiting(redis_client) == [hit for hit in before if hit is None or hit[0] != "a"]
    assert redis_client.keys(f"{QUEUE}{keys.PRIORITY_SEP}*") == []  # no scratch list left
    assert "cmdstat_lrem" not in calls  # one pass, not one O(queue) LREM per message
    assert purge_orders(redis_client, QUEUE, "a") == set()
