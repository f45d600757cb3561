"""A running batch's lease, kept alive by a heartbeat of its own.

The reaper re-enqueues a batch whose lease expired and which has no output, so a lease that
lapses on a live worker makes the batch run twice at once. The lease used to be refreshed by
the thread that also writes checkpoint parts and progress, and one slow S3 put could outlast
it. Here a daemon thread refreshes it every third of its TTL through a Redis client whose calls
time out well inside that third, whatever the batch thread is blocked on; a failed refresh is
logged and tried again at the next beat.
"""

from __future__ import annotations

import logging
import threading

import redis

from genfleet.common.redis_conn import RedisCommands

log = logging.getLogger("genfleet.tasks")


class Lease:
    """`with Lease(...)`: held (first write synchronous, so a Redis failure raises) until the
    block ends; then the heartbeat stops and the key is deleted, best effort."""

    def __init__(self, client: RedisCommands, key: str, holder: str, ttl_s: float) -> None:
        self.client = client
        self.key = key
        self.holder = holder
        self.ttl_ms = max(int(ttl_s * 1000), 1)
        self.interval_s = max(ttl_s / 3, 0.05)
        self.refreshes = 0
        self.failures = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._beat, name=f"lease:{key}", daemon=True)

    def __enter__(self) -> Lease:
        self.client.set(self.key, self.holder, px=self.ttl_ms)
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()

    def _beat(self) -> None:
        while not self._stop.wait(self.interval_s):
            try:
                self.client.set(self.key, self.holder, px=self.ttl_ms)
                self.refreshes += 1
            except redis.RedisError as exc:
                self.failures += 1
                log.warning("could not refresh the lease %s (%s): trying again", self.key, exc)

    def release(self) -> None:
        """Stop the heartbeat, then drop the key (so no refresh can follow the delete)."""
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=self.interval_s + 30)
        try:
            self.client.delete(self.key)
        except redis.RedisError:
            log.warning("could not drop the lease %s; it lapses in %d ms", self.key, self.ttl_ms)
