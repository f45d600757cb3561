"""Whether a worker may generate a work order it received: the run's model, cancel and delete.

Checked when a batch starts (or resumes, on a redelivery) and, for cancel, while it runs:

- an order for another model goes back to its own queue, never generated here (a worker
  serves one model; the emulator is a model of its own);
- an order of a deleted run, enqueued before the deletion, is dropped: a run of the same name
  staged since then must never receive another incarnation's batch;
- an order of a cancelled run is parked: acknowledged, not generated; its checkpoint stays,
  and enqueueing the run again (`genfleet enqueue --resume RUN`) sends it anew.
"""

from __future__ import annotations

import logging
from typing import Any, Literal

from genfleet.common import keys
from genfleet.common.records import WorkOrder
from genfleet.common.redis_conn import RedisCommands

log = logging.getLogger("genfleet.tasks")

Verdict = Literal["generate", "hand_back", "drop", "park"]


def decide(
    my_queue: str,
    its_queue: str,
    enqueued_at: float,
    deleted_at: float | None,
    cancelled: bool,
) -> Verdict:
    """What to do with an order, from the facts alone (a table test covers every row)."""
    if its_queue != my_queue:
        return "hand_back"
    if deleted_at is not None and enqueued_at <= deleted_at:
        return "drop"
    if cancelled:
        return "park"
    return "generate"


def gate(
    client: RedisCommands, work: WorkOrder, my_queue: str, its_queue: str
) -> dict[str, Any] | None:
    """None when this worker should generate `work`; else the task's result saying why not
    (for `hand_back`, the caller sends the order to `queue`)."""
    deleted = client.get(keys.deleted_key(work.run))
    verdict = decide(
        my_queue,
        its_queue,
        work.enqueued_at,
        float(deleted) if deleted is not None else None,
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
        park(client, work)
    return result


def park(client: RedisCommands, work: WorkOrder) -> None:
    """The batch has no order any more (until the run is enqueued again) and is not running."""
    pipe = client.pipeline()
    pipe.srem(keys.queued_key(work.run), work.batch)
    pipe.hdel(keys.running_key(), f"{work.run}/{work.batch}")
    pipe.execute()


def is_cancelled(client: RedisCommands, run: str) -> bool:
    """Polled by a running batch at each lease refresh."""
    return bool(client.exists(keys.cancelled_key(run)))
