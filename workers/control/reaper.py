"""The reaper: batches whose worker is gone, sent again, and poison parked.

A running batch whose worker died (its lease lapsed, or its named Redis connection is gone:
`workers.observe.liveness`) and that has no output is re-enqueued, once; an order delivered to
a dead worker and never claimed is given back. Either goes to the front of its queue: the dead
worker's copy of the order is moved to the consuming end (`Ledger.redeliver`), so the batch,
its answers in flight checkpointed, is taken by the next worker with room, not after every
order queued (a run of 100,000 batches would hold it back for hours, and its resumed answers
with it); only when no copy of that very order is left is a new one sent (to the back). A
batch whose worker died `max_deliveries` times is parked in the failed set as poison (it would
otherwise crash the fleet one worker at a time, forever). Then the orders a run counts as
queued that nothing holds are sent again (`workers.control.lost_orders`).

One pass at a time (`one_pass` takes a lock in Redis); `reap` decides and applies one pass over
the ledger's facts, with `now` a parameter and Redis's looks kept by `Lapses`.
"""

from __future__ import annotations

import logging
import uuid
from collections.abc import Callable
from typing import Any

import redis

from genfleet.common import keys
from genfleet.common.ledger import Delivery, Ledger, Running, UnackedIndex, running_field
from genfleet.common.redis_conn import RedisCommands, server_time, text
from genfleet.common.store import Store
from genfleet.workers.control.lost_orders import reconcile_orders
from genfleet.workers.observe.liveness import present

log = logging.getLogger("genfleet.tasks")


def one_pass(
    client: redis.Redis,
    store: Store,
    lease_ttl_s: float,
    max_deliveries: int,
    send: Callable[[dict[str, Any]], object],
    queue_of: Callable[[dict[str, Any]], str] | None = None,
) -> dict[str, Any]:
    """One reaper round of the control worker's beat: gone workers' batches moved to the front
    of their queue (`queue_of`) or sent again through `send`, and lost orders sent again,
    unless the last round's pass still runs."""
    token = uuid.uuid4().hex
    lock, ttl_ms = keys.reaping_key(), max(int(lease_ttl_s * 1000), 1)
    # Redis's clock, as the claims' times are (workers/admission.py): a control worker on a
    # host whose clock is off (or moved to another host) judges every claim and look alike.
    now = server_time(client)
    if not client.set(lock, token, nx=True, px=ttl_ms):
        # The last beat's pass still runs (slow under load, or Redis was away): one at a time.
        empty: dict[str, list[str]] = {k: [] for k in REAPED}
        return {**empty, "ts": now, "resent": [], "skipped": True}
    try:
        reaped = reap(
            client, store, lease_ttl_s, now, send, max_deliveries, present(client), queue_of
        )
        lost = reconcile_orders(
            client, store, lease_ttl_s, lambda o: send(o.model_dump()), server_time(client)
        )
    finally:
        if client.get(lock) == token.encode():
            client.delete(lock)
    return {**reaped, "resent": lost["resent"]}


# What a reaper pass reports; `counted`: of the finished, those whose worker was lost before
# it counted them.
REAPED = ("requeued", "finished", "counted", "parked", "given_back")


def reap(
    client: RedisCommands,
    store: Store,
    lease_ttl_s: float,
    now: float,
    requeue: Callable[[dict[str, Any]], object],
    max_deliveries: int = 3,
    present: set[str] | None = None,
    queue_of: Callable[[dict[str, Any]], str] | None = None,
) -> dict[str, Any]:
    """One reaper pass over the running batches: a batch whose worker is gone is finished
    when its output exists (its entry is dropped), else sent again, once: the dead worker's
    copy of its order moved to the front of its queue (`queue_of(order)`, when given), or
    else a new one `requeue`d; or parked in the failed set when its worker died
    `max_deliveries` times. Then the orders delivered to a gone worker and never claimed go
    the same way.

    Gone, on two looks half a lease apart: its lease expired, or (`present`: the names of the
    workers' connections Redis holds, None when unknown) its worker's connection is not
    there. The second is known a lease sooner: a dead process's connections close at once."""
    found: dict[str, list[str]] = {k: [] for k in REAPED}
    ledger = Ledger(client)
    lapses = Lapses(client, lease_ttl_s)  # type: ignore[arg-type]
    deliveries = ledger.deliveries()  # before the unacked hash: see _unclaimed
    unacked = ledger.unacked_index()  # scanned once a pass, when first asked
    running = ledger.running()
    for claimed in running:
        run, batch = claimed.run, claimed.batch
        absent = _absent(claimed.presence, present)
        if not absent and client.exists(keys.lease_key(run, batch)):
            continue
        if not absent and now - claimed.claimed_at < lease_ttl_s:
            continue  # claimed but the first lease write may not have landed yet
        if not lapses.confirmed(claimed.field, now):
            continue  # a first look: a live worker re-sets its lease within a heartbeat
        if store.exists(keys.output_key(run, batch)):
            # Its worker may have been lost between the output and its count: counted now
            # unless it was, so the run reads done without waiting for a reconcile pass.
            if ledger.found_written(run, batch, int(claimed.entry.get("prompts", 0))):
                found["counted"].append(claimed.field)
            ledger.release(run, batch)
            found["finished"].append(claimed.field)
            continue
        if client.exists(keys.cancelled_key(run), keys.deleted_key(run)) and ledger.park(
            run, batch
        ):
            continue  # nothing to redo: parked (unless resumed meanwhile: lost, below)
        if not ledger.release_claim(claimed):
            continue  # another reaper won this one, or a live worker claimed it again
        outcome = _lost(ledger, unacked, claimed, requeue, max_deliveries, queue_of)
        found[outcome].append(claimed.field)
    claimed_fields = {c.field for c in running}
    orphans = _unclaimed(ledger, unacked, deliveries, claimed_fields, present, lapses, now)
    for orphan in orphans:
        if store.exists(keys.output_key(orphan.run, orphan.batch)):
            ledger.drop_unacked(unacked.copies(orphan.run, orphan.batch))
            continue
        outcome = _lost(ledger, unacked, orphan, requeue, max_deliveries, queue_of)
        found["given_back" if outcome == "requeued" else outcome].append(orphan.field)
    lapses.forget_others()
    return {**found, "ts": now}


def _absent(name: str | None, present: set[str] | None) -> bool:
    """Whether a worker's named connection is known to be gone (never for an unnamed one)."""
    return present is not None and name is not None and name not in present


def _unclaimed(
    ledger: Ledger,
    unacked: UnackedIndex,
    deliveries: dict[str, Delivery],
    claimed: set[str],
    present: set[str] | None,
    lapses: Lapses,
    now: float,
) -> list[Running]:
    """The work orders delivered to a worker that is gone and never claimed (no running
    entry), each as the claim it never made. Their owner is recorded at delivery
    (`Ledger.delivered`); an order with no owner on record for half a lease is one whose
    worker died before it could record it. The deliveries kombu no longer holds are forgotten
    (`deliveries` was read before the unacked hash, so none is forgotten as it arrives)."""
    orphans: list[Running] = []
    ledger.forget_deliveries(set(deliveries) - {u.tag for u in unacked.orders()})
    for order in unacked.orders():
        field = running_field(order.run, order.batch)
        if field in claimed:
            continue
        owner = deliveries.get(order.tag)
        if owner is not None and not _absent(owner.presence, present):
            continue  # its worker lives (or cannot be judged): it claims it, or acks it
        if not lapses.confirmed(f"delivered:{order.tag}", now):
            continue
        worker = owner.worker if owner is not None else "a worker that never said so"
        orphans.append(Running(field, {**order.order, "worker": worker}))
    return orphans


def _lost(
    ledger: Ledger,
    unacked: UnackedIndex,
    claimed: Running,
    requeue: Callable[[dict[str, Any]], object],
    max_deliveries: int,
    queue_of: Callable[[dict[str, Any]], str] | None = None,
) -> str:
    """A delivery ended with its worker dead or vanished: re-enqueue it, or park it as poison
    once that has happened `max_deliveries` times. Returns "requeued" or "parked".

    Re-enqueued at the front of its queue when a copy of this very order is still held for
    the dead worker (`queue_of` given): that copy is moved there. A copy of another order of
    the batch (an earlier staging's) is never the one moved: it would be dropped as superseded.

    The broker's unacked copies of the order (the dead worker's delivery) would be delivered
    again after its visibility timeout, hours later, a copy the reaper has replaced; and
    `retry` takes an unacked copy for an outstanding order, so it would not resend a parked
    batch. They are dropped once the outcome is recorded; an ack for a dropped tag is a no-op.
    """
    run, batch = claimed.run, claimed.batch
    lost = ledger.lost(run, batch)
    dead = unacked.copies(run, batch)
    if lost >= max_deliveries:
        reason = (
            f"poison batch: its worker died or vanished in {lost} deliveries (the last on "
            f"{claimed.worker}); parked, `genfleet retry {run}` resends it"
        )
        ledger.poison(run, batch, reason)
        ledger.drop_unacked(dead)
        log.error("%s/%s: %s", run, batch, reason)
        return "parked"
    order = claimed.order()
    try:
        front = _to_the_front(ledger, unacked, order, queue_of)
        if not front:
            requeue(order)
    except Exception:
        # Not sent: give the entry back so the next round tries again (never lose the order).
        ledger.unlose(claimed)
        raise
    ledger.drop_unacked(dead)
    log.warning(
        "%s/%s: its worker %s is gone and it has no output: re-enqueued %s (delivery %d of "
        "at most %d ended with its worker gone)",
        run,
        batch,
        claimed.worker,
        "at the front" if front else "at the back",
        lost,
        max_deliveries,
    )
    return "requeued"


def _to_the_front(
    ledger: Ledger,
    unacked: UnackedIndex,
    order: dict[str, Any],
    queue_of: Callable[[dict[str, Any]], str] | None,
) -> bool:
    """Move one unacknowledged copy of exactly `order` to the consuming end of its queue;
    False when there is none (or none is known to be its queue)."""
    if queue_of is None:
        return False
    queue = queue_of(order)
    return any(ledger.redeliver(tag, queue) for tag in unacked.carrying(order))


def lapse_confirmed(first_seen_s: float | None, now: float, lease_ttl_s: float) -> bool:
    """Whether a lease seen lapsed now (and first at `first_seen_s`, None: this is the first
    look) has stayed lapsed long enough to mean its worker is gone: half a lease, more than
    the heartbeat's third, so a live worker whose lease lapsed while Redis was away (a blip
    longer than the lease) has re-set it by the second look.

    >>> lapse_confirmed(None, 100.0, 60.0), lapse_confirmed(80.0, 100.0, 60.0)
    (False, False)
    >>> lapse_confirmed(70.0, 100.0, 60.0)
    True
    """
    return first_seen_s is not None and now - first_seen_s >= lease_ttl_s / 2


class Lapses:
    """The reaper's looks at lapsed leases, kept in Redis between its passes (one beat, one
    clock): `confirmed(field, now)` records a first look and answers `lapse_confirmed`."""

    def __init__(self, client: redis.Redis, lease_ttl_s: float) -> None:
        self.client = client
        self.lease_ttl_s = lease_ttl_s
        self.seen = {text(k): float(v) for k, v in client.hgetall(keys.lapsed_key()).items()}
        self.looked: set[str] = set()

    def confirmed(self, field: str, now: float) -> bool:
        self.looked.add(field)
        first = self.seen.get(field)
        if first is None:
            self.client.hset(keys.lapsed_key(), field, now)
        return lapse_confirmed(first, now, self.lease_ttl_s)

    def forget_others(self) -> None:
        """Drop the looks at leases that are no longer lapsed (alive again, or reaped)."""
        stale = [f for f in self.seen if f not in self.looked]
        if stale:
            self.client.hdel(keys.lapsed_key(), *stale)
