"""Lost orders: batches a run counts as queued that no order holds any more, sent again.

An order can vanish with nothing to show for it: a hand-back or a retry that the broker
refused after the old message was acked, a message removed by hand, a queue purged. The
batch then stays in its run's `queued` set forever, and `run` / `status --watch` wait for it.
The lease reaper cannot help: no worker ever claimed it.

So the control worker's beat looks, every reaper round, at each run's `queued` batches: one
that is neither done (its output in the store), waiting in the broker, delivered and not
acked, nor running, is missing. A batch missing for longer than a lease on two looks (an
order moves between those places in milliseconds: popped from the queue before it is in the
unacked hash, acked before its retry is sent) is sent again from the run's manifest (the one
shard holding its entry). Each batch's first missing look is kept in Redis by the one beat,
on its own clock.

A pass costs what the fleet holds, not what the run has left: while more than
`MAX_WAITING` orders wait in the work queues it looks no further (the workers have work; a
lost order delays nothing until the queues drain, and then it is found within a lease), and
it looks at no more than `MAX_BATCHES` queued batches a pass (a queue purged of a whole run's
orders is sent again over several passes). The queued sets and the queues are otherwise read
whole: 0.8 s and 45 MB a pass at 20,000 waiting orders when they were read at every size.

`reconcile()` decides, from facts alone (a table test covers it); `reconcile_orders()` reads
the facts and applies the decision.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import redis

from genfleet.common import keys, run_registry
from genfleet.common.errors import GenfleetError
from genfleet.common.ledger import Ledger, work_order_of
from genfleet.common.manifest import Manifest
from genfleet.common.queue_depth import orders_waiting
from genfleet.common.records import WorkOrder
from genfleet.common.redis_conn import text
from genfleet.common.store import Store

log = logging.getLogger("genfleet.tasks")

# Orders waiting in the work queues above which a pass looks no further (it reads them whole).
MAX_WAITING = 5_000
# Queued batches a pass looks at, over all runs (each not held costs a store lookup).
MAX_BATCHES = 20_000


@dataclass(frozen=True)
class RunOrders:
    """What is known of one run's orders at one look."""

    queued: frozenset[str]  # the run's `queued` set: batches it believes have an order
    held: frozenset[str]  # batches with an order: waiting, delivered (unacked) or running
    done: frozenset[str]  # queued batches, not held, whose output exists


@dataclass
class Plan:
    resend: list[str] = field(default_factory=list)  # missing longer than a lease
    missing_since: dict[str, float] = field(default_factory=dict)  # missing, not yet for long
    finished: list[str] = field(default_factory=list)  # queued but done: not queued any more


def reconcile(
    orders: RunOrders, missing_since: Mapping[str, float], now: float, lease_ttl_s: float
) -> Plan:
    """What to do with one run's queued batches, given when each was first seen missing.

    >>> v = reconcile(RunOrders(frozenset({"a", "b", "c"}), frozenset({"a"}), frozenset({"b"})),
    ...               {"c": 0.0}, now=61.0, lease_ttl_s=60.0)
    >>> v.resend, v.missing_since, v.finished
    (['c'], {}, ['b'])
    """
    verdict = Plan()
    for batch in sorted(orders.queued - orders.held):
        if batch in orders.done:
            verdict.finished.append(batch)
            continue
        since = missing_since.get(batch, now)
        if now - since >= lease_ttl_s:
            verdict.resend.append(batch)
        else:
            verdict.missing_since[batch] = since
    return verdict


def held_orders(client: redis.Redis, queues: Iterable[str]) -> set[tuple[str, str]]:
    """(run, batch) of every order the broker or a worker holds: waiting in one of `queues`,
    delivered and not acked, or running (a running entry)."""
    held: set[tuple[str, str]] = set()
    for queue in queues:
        for list_key in keys.broker_queue_keys(queue):
            for raw in client.lrange(list_key, 0, -1):
                if (order := work_order_of(raw)) is not None:
                    held.add(order)
    ledger = Ledger(client)
    held.update((u.run, u.batch) for u in ledger.unacked_orders())
    held.update((r.run, r.batch) for r in ledger.running())
    return held


def order_of(manifest: Manifest, store: Store, batch: str, now: float) -> WorkOrder | None:
    """The work order of `batch` as `enqueue` sends it (bound to the run's staging and the
    batch's content hash), from the one shard of the run's manifest that holds it; None for
    a batch it does not list or a run staged without a model (it cannot be routed)."""
    if manifest.model is None or manifest.engine is None:
        return None
    entry = manifest.entry(store, batch)
    if entry is None:
        return None
    return WorkOrder(
        run=manifest.run,
        batch=batch,
        key=entry.key,
        params=manifest.params,
        model=manifest.model,
        engine=manifest.engine,
        prompts=entry.prompts,
        enqueued_at=now,
        input_sha256=entry.sha256,
        staging=manifest.staging_id,
    )


def reconcile_orders(
    client: redis.Redis,
    store: Store,
    lease_ttl_s: float,
    send: Callable[[WorkOrder], object],
    now: float | None = None,
) -> dict[str, Any]:
    """One pass over every run with queued batches: lost orders sent again (`send`), done
    batches taken off the queued set. Returns what it did, by `run/batch`."""
    now = time.time() if now is None else now
    found: dict[str, Any] = {"resent": [], "finished": [], "ts": now}
    queues = [text(q) for q in client.smembers(keys.work_queues_key())]
    waiting = orders_waiting(client, queues)
    if waiting > MAX_WAITING:
        found["deferred"] = waiting  # the watch is kept as it is for the next pass
        return found
    ledger = Ledger(client)
    queued: dict[str, set[str]] = {}
    partly: set[str] = set()  # runs whose queued set was not read whole (or not at all)
    budget = MAX_BATCHES
    for run in run_registry.runs(client):
        if budget <= 0:
            partly.add(run)
            continue
        batches = ledger.queued_some(run, budget)
        if len(batches) >= budget:
            partly.add(run)
        if batches:
            queued[run] = batches
            budget -= len(batches)
    if not queued:
        return found
    held = held_orders(client, queues)
    since = {text(k): float(v) for k, v in client.hgetall(keys.missing_key()).items()}
    watched: dict[str, float] = {}
    for run, batches in queued.items():
        if client.exists(keys.cancelled_key(run), keys.deleted_key(run)):
            continue
        mine = frozenset(b for r, b in held if r == run)
        candidates = batches - mine
        done = frozenset(b for b in candidates if store.exists(keys.output_key(run, b)))
        verdict = reconcile(
            RunOrders(frozenset(batches), mine, done),
            {b: t for f, t in since.items() for r, _, b in [f.partition("/")] if r == run},
            now,
            lease_ttl_s,
        )
        watched.update({f"{run}/{b}": t for b, t in verdict.missing_since.items()})
        if verdict.finished:
            ledger.unqueue(run, verdict.finished)
            found["finished"] += [f"{run}/{b}" for b in verdict.finished]
        if verdict.resend:
            found["resent"] += _resend(store, run, verdict.resend, now, send)
    # A watched batch of a run read in part may simply not have been looked at: kept.
    for name, first in since.items():
        run, _, batch = name.partition("/")
        if run in partly and batch not in queued.get(run, ()):
            watched[name] = first
    _keep_watch(client, since, watched)
    return found


def _resend(
    store: Store, run: str, batches: list[str], now: float, send: Callable[[WorkOrder], object]
) -> list[str]:
    sent: list[str] = []
    try:
        manifest = Manifest.load(store, run)
    except (GenfleetError, ValueError) as exc:
        log.error("%s: its manifest cannot be read (%s): lost orders not sent again", run, exc)
        return sent
    for batch in batches:
        try:
            order = order_of(manifest, store, batch, now) if manifest is not None else None
        except GenfleetError as exc:  # a shard missing or damaged: this batch, logged
            log.error("%s/%s: %s", run, batch, exc)
            continue
        if order is None:
            log.error(
                "%s/%s is queued but has no order, and none can be made from its "
                "manifest: `genfleet enqueue --resume %s`",
                run,
                batch,
                run,
            )
            continue
        send(order)
        sent.append(f"{run}/{batch}")
        log.warning(
            "%s/%s was queued but no order held it for a lease (none waiting, delivered or "
            "running; no output): sent again",
            run,
            batch,
        )
    return sent


def _keep_watch(client: redis.Redis, before: Mapping[str, float], now: Mapping[str, float]) -> None:
    """The missing batches' first looks, for the next pass; the others forgotten."""
    pipe = client.pipeline()
    gone = [f for f in before if f not in now]
    if gone:
        pipe.hdel(keys.missing_key(), *gone)
    for name, since in now.items():
        if before.get(name) != since:
            pipe.hset(keys.missing_key(), name, since)
    pipe.execute()
