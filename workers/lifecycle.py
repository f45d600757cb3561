"""Whether a worker may generate a work order it received: the run's model, cancel and delete.

Checked when a batch starts (or resumes, on a redelivery) and, for cancel, while it runs:

- an order for another model goes back to its own queue, never generated here (a worker
  serves one model; the emulator is a model of its own);
- an order of a deleted run is dropped: a run of the same name staged since then must never
  receive another incarnation's batch. The deletion's tombstone names the staging it
  deleted, and an order names its staging, so no clock of two hosts is compared (the
  store's claim is checked again before every write: `genfleet.workers.provenance`);
- an order of a cancelled run is parked: acknowledged, not generated; its checkpoint stays,
  and enqueueing the run again (`genfleet enqueue --resume RUN`) sends it anew.

While a batch runs, its `Lease` says a live worker holds it (below).
"""

from __future__ import annotations

import logging
import threading
from typing import Any, Literal

import redis

from genfleet.common import keys
from genfleet.common.ledger import Ledger
from genfleet.common.records import WorkOrder
from genfleet.common.redis_conn import RedisCommands

log = logging.getLogger("genfleet.tasks")

Verdict = Literal["generate", "hand_back", "drop", "park"]


def decide(my_queue: str, its_queue: str, deleted: bool, cancelled: bool) -> Verdict:
    """What to do with an order, from the facts alone (a table test covers every row).
    `deleted`: the order's staging is the one a deletion removed (`deleted_staging`)."""
    if its_queue != my_queue:
        return "hand_back"
    if deleted:
        return "drop"
    if cancelled:
        return "park"
    return "generate"


def gate(
    client: RedisCommands, work: WorkOrder, my_queue: str, its_queue: str
) -> dict[str, Any] | None:
    """None when this worker should generate `work`; else the task's result saying why not
    (for `hand_back`, the caller sends the order to `queue`)."""
    tombstone = client.get(keys.deleted_key(work.run))
    verdict = decide(
        my_queue,
        its_queue,
        deleted_staging(tombstone, work.staging),
        is_cancelled(client, work.run),
    )
    result: dict[str, Any] = {"run": work.run, "batch": work.batch, verdict: True}
    if verdict == "generate":
        return None
    if verdict == "hand_back":
        log.warning(
            "%s/%s is for model %r (%s), but this worker serves queue %s: handed back to %s, "
            "not generated",
            work.run,
            work.batch,
            work.model,
            work.engine,
            my_queue,
            its_queue,
        )
        result["handed_back"] = True
        result["queue"] = its_queue
    elif verdict == "drop":
        log.warning("%s/%s belongs to a deleted run: dropped", work.run, work.batch)
    else:
        log.warning("%s/%s: the run is cancelled; batch parked, not started", work.run, work.batch)
        Ledger(client).park(work.run, work.batch)
    return result


def deleted_staging(tombstone: bytes | str | None, staging: str) -> bool:
    """Whether a deletion's tombstone (`keys.deleted_key`, holding the staging id it
    deleted) covers an order of `staging`. An order of an older genfleet names no staging:
    every one is dropped while the tombstone lives."""
    if tombstone is None:
        return False
    deleted = tombstone.decode() if isinstance(tombstone, bytes) else str(tombstone)
    return not staging or deleted == staging


def is_cancelled(client: RedisCommands, run: str) -> bool:
    """Polled by a running batch at each lease refresh."""
    return bool(client.exists(keys.cancelled_key(run)))


# --- the lease of a running batch ----------------------------------------------------------
#
# A running batch's lease, kept alive by a heartbeat of its own.
#
# The reaper re-enqueues a batch whose lease expired and which has no output, so a lease that
# lapses on a live worker makes the batch run twice at once. The lease used to be refreshed by
# the thread that also writes checkpoint parts and progress, and one slow S3 put could outlast
# it. Here a daemon thread refreshes it every third of its TTL through a Redis client whose calls
# time out well inside that third, whatever the batch thread is blocked on; a failed refresh is
# logged and tried again at the next beat.


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
