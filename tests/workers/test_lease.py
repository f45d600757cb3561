"""The lease heartbeat keeps the key alive on its own, and nothing refreshes it after release."""

from __future__ import annotations

import redis

from genfleet.workers.lease import Lease
from harness.waits import wait_for


def test_lease_outlives_its_ttl_while_held_and_is_gone_after(redis_client: redis.Redis) -> None:
    lease = Lease(redis_client, "genfleet:lease:r:batch-000001", "w@test", ttl_s=0.3)
    with lease:
        # Ten refreshes span a full second: three TTLs with the holder never touching it.
        wait_for(lambda: lease.refreshes >= 10, 10, "ten heartbeats")
        assert redis_client.get(lease.key) == b"w@test"
        assert 0 < redis_client.pttl(lease.key) <= 300
    assert not redis_client.exists(lease.key)
    assert not lease._thread.is_alive()
