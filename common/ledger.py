"""The ledger: a batch's state in Redis, and the only code that writes or reads it.

The store is the truth for what is done (an output object exists); Redis says where every
other batch stands, so that nothing is sent twice, lost or retried forever:

    (staged) ──mark_queued──▶ queued ──claim──▶ running ──done──▶ done (its output exists)
                                ▲                 ├──fail────▶ failed  (tries spent, or permanent)
                                │                 ├──park────▶ parked  (run cancelled: no order)
                                │                 ├──release─▶ queued  (handed back, requeued,
                                │                 │             retried: the order goes on)
                                │                 └──lost────▶ lost    (its worker died: the
                                │                                reaper requeues it, or after
                                │                                max_deliveries: poison → failed)
                                └── enqueue again, `retry` (clear_failed)

The keys (names and reasons in common/keys.py) and who else may touch them — no one:

- `queued_key(run)`: set of batches with a work order outstanding;
- `running_key()`: hash "run/batch" (`running_field`) → the order as claimed, with
  `claimed_at` and `worker`, scanned by the lease reaper;
- `cancelled_key(run)`: the run's orders held (`cancel`, the quality gate's pause) until an
  enqueue resumes it (`hold`, `release_hold`; read where an order is admitted or parked);
- `failed_key(run)`: hash batch → the last error of a batch that is parked for `retry`;
- `attempts_key(run)`: hash batch → tries that failed;
- `lost_key(run)`: hash batch → deliveries that ended with their worker gone;
- kombu's `unacked` hash (and its `unacked_index`): messages delivered and not acknowledged;
  `work_order_of` is the one parser of a kombu message on Redis.

The run's live counters (common/counters.py), its tok/s buckets and the progress copy of
common/progress.py are written in this module's pipelines, by their owners' functions, where
they move with a batch's state (`done`, `progress`). `done`, `progress`, `fail`, `park`,
`poison`, `clear_failed` and `drop_unacked` send their commands as one MULTI/EXEC pipeline; the
others are one command, or (`set_queued`, `unlose`, `purge_unacked`) a few in a row. Redis
errors propagate: what a failure to record means is the caller's decision (the task requeues
its message, the reaper tries again at its next beat, the CLI says so), never this module's.

As arq's `Worker.finish_job` is the one writer of a job's keys and `Job` their reader, a module
that needs a batch's state asks a `Ledger` (a test greps the package for the key names).
"""

from __future__ import annotations

import base64
import contextlib
import itertools
import uuid
from collections.abc import Collection, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import orjson

from genfleet.common import counters, keys, progress, throughput
from genfleet.common.celery_config import GENERATE_TASK
from genfleet.common.redis_conn import RedisCommands, text
from genfleet.common.waste import WasteTally

# A failed batch's reason is shown by `status`; a traceback-sized message is cut here.
REASON_MAX_CHARS = 2000
# Entries of kombu's unacked hash read per HSCAN call.
UNACKED_PAGE = 1000


# Park a batch only while its run is cancelled or deleted (`Ledger.park`): KEYS cancelled,
# deleted, queued, running; ARGV batch, running field.
PARK_SCRIPT = """
if redis.call('EXISTS', KEYS[1], KEYS[2]) == 0 then return 0 end
redis.call('SREM', KEYS[3], ARGV[1])
redis.call('HDEL', KEYS[4], ARGV[2])
return 1
"""
# Move an unacknowledged delivery to the consuming end of a queue list, only while kombu still
# holds it as read (`Ledger.redeliver`): KEYS unacked, unacked index, queue list; ARGV tag,
# the entry as read, the message to push.
REDELIVER_SCRIPT = """
if redis.call('HGET', KEYS[1], ARGV[1]) ~= ARGV[2] then return 0 end
redis.call('HDEL', KEYS[1], ARGV[1])
redis.call('ZREM', KEYS[2], ARGV[1])
redis.call('RPUSH', KEYS[3], ARGV[3])
return 1
"""
# Remove a running entry only if its order is of the given staging (`release_staging`): an
# entry of an order that names no staging is an older genfleet's, of no staging to compare.
RELEASE_STAGING_SCRIPT = """
local raw = redis.call('HGET', KEYS[1], ARGV[1])
if not raw then return 0 end
local entry = cjson.decode(raw)
local staging = entry['staging']
if staging ~= nil and staging ~= cjson.null and staging ~= '' and staging ~= ARGV[2] then
  return 0
end
return redis.call('HDEL', KEYS[1], ARGV[1])
"""


def running_field(run: str, batch: str) -> str:
    """The member naming a batch in the running hash ("run/batch")."""
    return f"{run}/{batch}"


def work_order_of(message: bytes | str) -> tuple[str, str] | None:
    """(run, batch) of a raw kombu message on Redis if it is a genfleet work order, else None
    (another task's message, or one that does not parse)."""
    try:
        return _order_in(orjson.loads(message))
    except ValueError:
        return None


def _order_in(data: Any) -> tuple[str, str] | None:
    order = _work_order(data)
    return None if order is None else (str(order["run"]), str(order["batch"]))


def _work_order(data: Any) -> dict[str, Any] | None:
    """The work order a kombu message carries, if it is a genfleet work order."""
    try:
        if data.get("headers", {}).get("task") != GENERATE_TASK:
            return None
        body = data["body"]
        if data.get("properties", {}).get("body_encoding") == "base64":
            body = base64.b64decode(body)
        order = orjson.loads(body)[1]["order"]
        return dict(order) if "run" in order and "batch" in order else None
    except (ValueError, KeyError, IndexError, TypeError, AttributeError):
        return None


@dataclass(frozen=True)
class Running:
    """A claimed batch as the running hash holds it: its field and the claimed order."""

    field: str
    entry: dict[str, Any]

    @property
    def run(self) -> str:
        return str(self.entry["run"])

    @property
    def batch(self) -> str:
        return str(self.entry["batch"])

    @property
    def claimed_at(self) -> float:
        return float(self.entry.get("claimed_at", 0))

    @property
    def worker(self) -> str:
        return str(self.entry.get("worker", "an unknown worker"))

    @property
    def presence(self) -> str | None:
        """The name of the claiming worker's connection (workers/observe/liveness.py), if it had
        one."""
        name = self.entry.get("presence")
        return str(name) if name else None

    def order(self) -> dict[str, Any]:
        """The work order as it was sent (what the reaper enqueues again)."""
        return {k: v for k, v in self.entry.items() if k not in _CLAIM_FIELDS}


_CLAIM_FIELDS = ("claimed_at", "worker", "presence")


@dataclass(frozen=True)
class Unacked:
    """A work order kombu delivered and holds unacknowledged, by its delivery tag."""

    tag: str
    run: str
    batch: str
    order: dict[str, Any] = field(default_factory=dict, compare=False)


@dataclass(frozen=True)
class Delivery:
    """To whom a work order was delivered: its worker and that worker's connection name."""

    worker: str
    presence: str | None


@dataclass(frozen=True)
class Tally:
    """What a batch's output holds, added to the run's counters by the copy that wrote it."""

    errors: int
    completion_tokens: int
    reasoning_tokens: int
    done_at: float
    # More of the run's counters to add: where the batch's tokens went (common/waste.py).
    more: dict[str, int] = field(default_factory=dict)


class Ledger:
    """A batch's state on one Redis client (`redis.Redis`, or the tests' MemoryRedis)."""

    def __init__(self, client: RedisCommands) -> None:
        self.client = client

    # --- queued: a work order is outstanding -----------------------------------------------

    def mark_queued(self, run: str, batches: Collection[str]) -> None:
        """Called by enqueue just before it sends these batches' orders: a second enqueue of
        the run (or a resume) does not send them again."""
        if batches:
            self.client.sadd(keys.queued_key(run), *batches)

    def queued(self, run: str) -> set[str]:
        """The batches enqueue believes have an order outstanding (what it will not resend)."""
        return {text(b) for b in self.client.smembers(keys.queued_key(run))}

    def queued_some(self, run: str, limit: int) -> set[str]:
        """At most about `limit` of the run's queued batches (SSCAN: a pass that must not cost
        more as the set grows reads a bounded part of it)."""
        some: set[str] = set()
        for batch in self.client.sscan_iter(keys.queued_key(run), count=min(limit, 1000)):
            some.add(text(batch))
            if len(some) >= limit:
                break
        return some

    def queued_count(self, run: str) -> int:
        """How many batches of `run` wait for a worker (the power-watch's pending work)."""
        return int(self.client.scard(keys.queued_key(run)))

    def set_queued(self, run: str, batches: Collection[str]) -> None:
        """Called by `--resume` and `retry` with the orders the broker really holds: the set
        then forgets orders a purged queue or a lost message took away, so they are resent."""
        self.client.delete(keys.queued_key(run))
        if batches:
            self.client.sadd(keys.queued_key(run), *batches)

    def unqueue(self, run: str, batches: Collection[str]) -> None:
        """Called by `cancel` for the orders it removed from the queue: they are gone, and
        enqueueing the run again sends them anew."""
        if batches:
            self.client.srem(keys.queued_key(run), *batches)

    # --- running: a worker claimed it ------------------------------------------------------

    def claim(
        self, order: Mapping[str, Any], worker: str, now: float, presence: str | None = None
    ) -> None:
        """Called by the task when it admits an order, before any work: the running entry
        (the order as sent, with when and by whom, and the name of the worker's connection)
        is what the reaper re-enqueues if the worker vanishes with its lease."""
        field = running_field(str(order["run"]), str(order["batch"]))
        entry = {**order, "claimed_at": now, "worker": worker}
        if presence:
            entry["presence"] = presence
        self.client.hset(keys.running_key(), field, orjson.dumps(entry))

    def release(self, run: str, batch: str) -> bool:
        """The batch no longer runs under this claim: it finished, or its message goes back to
        the queue (handed back, shutdown, a retry), or the reaper takes it over. True when
        this call removed the entry (two reapers: only the one that removed it goes on)."""
        return bool(self.client.hdel(keys.running_key(), running_field(run, batch)))

    def release_claim(self, claimed: Running) -> bool:
        """The reaper takes over `claimed`: its entry goes only if it is still that claim
        (True). Another pass may have taken it already, or a live worker claimed the batch
        again since this pass read it (its order was sent again): that claim stays. (A claim
        landing between this read and the delete is not seen; the window is one round trip.)"""
        raw = self.client.hget(keys.running_key(), claimed.field)
        if raw is None or orjson.loads(raw) != claimed.entry:
            return False
        return bool(self.client.hdel(keys.running_key(), claimed.field))

    def running(self) -> list[Running]:
        """Every claimed batch of every run (the reaper's pass, once a beat)."""
        return [
            Running(text(field), orjson.loads(raw))
            for field, raw in self.client.hgetall(keys.running_key()).items()
        ]

    def running_batches(self, run: str) -> set[str]:
        """Batches of `run` that a worker claimed (`--resume` counts them as outstanding)."""
        prefix = running_field(run, "")
        return {
            name[len(prefix) :]
            for name in (text(f) for f in self.client.hkeys(keys.running_key()))
            if name.startswith(prefix)
        }

    def forget_running(self, run: str) -> int:
        """Called by `delete` once no batch of the run runs: drops its leftover claims;
        returns how many."""
        prefix = running_field(run, "")
        fields = [f for f in self.client.hkeys(keys.running_key()) if text(f).startswith(prefix)]
        return int(self.client.hdel(keys.running_key(), *fields)) if fields else 0

    # --- outcomes of a try -----------------------------------------------------------------

    def done(
        self,
        run: str,
        batch: str,
        tally: Tally | None = None,
        prompts: int = 0,
        late_copy_tokens: int | None = None,
    ) -> None:
        """Called once the batch's output exists in the store: no order outstanding, not
        failed, in the run's progress copy with its `prompts` (common/progress.py). With
        `tally` (the copy that wrote the output, not a duplicate) the run's done counters and
        `prompts_done` move in the same transaction. With `late_copy_tokens` (a copy that
        generated the batch and found its output written by another) the run counts the late
        copy and what it threw away. The store's listing stays the truth."""
        pipe = self.client.pipeline()
        pipe.srem(keys.queued_key(run), batch)
        pipe.hdel(keys.failed_key(run), batch)
        if tally is not None:
            counts = [
                ("errors", tally.errors),
                ("completion_tokens", tally.completion_tokens),
                ("reasoning_tokens", tally.reasoning_tokens),
                *tally.more.items(),
            ]
            counters.add_done(pipe, run, counts, tally.done_at)
            progress.mark_written(pipe, run, batch, prompts)
        else:
            progress.mark_seen(pipe, run, batch, prompts)
            if late_copy_tokens is not None:
                late = WasteTally.late_copy(late_copy_tokens).to_counters()
                counters.add_late_copy(pipe, run, late.items())
        pipe.execute()

    def found_written(self, run: str, batch: str, prompts: int) -> bool:
        """Called by the reaper for a batch whose worker is gone and whose output exists: no
        order outstanding, not failed, and counted with its `prompts` unless its writer
        counted it before it was lost (True when this call counted it). Without it the run
        read done only at the next reconcile pass (`--reconcile-interval-s`, 120 s): in the
        long chaos bench, 68 s after its last answer was stored."""
        pipe = self.client.pipeline()
        pipe.srem(keys.queued_key(run), batch)
        pipe.hdel(keys.failed_key(run), batch)
        pipe.execute()
        return progress.mark_found(self.client, run, batch, prompts)

    def progress(self, worker: str, counts: Mapping[str, tuple[int, int]], now: float) -> None:
        """Called by a worker once an interval (workers/observe/live_progress.py) with what its
        running batches generated since, by run (prompts, tokens): live progress and the tok/s
        buckets (common/throughput.py), one pipeline for all of them. These count what the
        GPUs did, a batch delivered twice counts twice; `done` counts what is in the store."""
        pipe = self.client.pipeline()
        for run, (prompts, tokens) in counts.items():
            counters.add_generated(pipe, run, prompts, tokens)
            throughput.add(pipe, run, worker, tokens, now)
        pipe.execute()

    def tried(self, run: str, batch: str) -> int:
        """Called when a try failed with a retryable error: counts it; returns the tries so
        far, which the task compares with `batch_retries`."""
        return int(self.client.hincrby(keys.attempts_key(run), batch, 1))

    def fail(self, run: str, batch: str, reason: str) -> None:
        """Called when the batch cannot succeed (tries spent, input gone, terminated, an
        unforeseen error): it is parked in the failed set with `reason`, where `status`
        shows it and `retry` resends it; no order outstanding, not running."""
        pipe = self.client.pipeline()
        pipe.hset(keys.failed_key(run), batch, reason[:REASON_MAX_CHARS])
        pipe.srem(keys.queued_key(run), batch)
        pipe.hdel(keys.running_key(), running_field(run, batch))
        pipe.execute()

    def hold(self, run: str, now: float) -> bool:
        """Called by `cancel` and by the quality gate's pause: the run's orders are held (its
        cancelled flag, which admission, a running batch's lease and the reaper read; `park`
        parks only while it stands). True when this call set it (not held already)."""
        return bool(self.client.set(keys.cancelled_key(run), now, nx=True))

    def release_hold(self, run: str) -> bool:
        """Called by an enqueue of the run (a resume): its orders are no longer held. True
        when the run was held. Before the resume lists what is outstanding (`park`)."""
        return bool(self.client.delete(keys.cancelled_key(run)))

    def park(self, run: str, batch: str) -> bool:
        """Called when the run is cancelled (at admission, while the batch ran, or by the
        reaper): the batch has no order any more until the run is enqueued again, and is not
        running; its checkpoint stays. Only while the run is still cancelled (or deleted),
        in one step with that check: False when it was resumed since the caller looked. A
        resume lists what is outstanding after it clears the flag, so a park that landed
        before is resent and one after it must not happen (the batch would have no order and
        no state a reconciler reads): the caller runs or requeues the batch instead."""
        parked = self.client.eval(
            PARK_SCRIPT,
            4,
            keys.cancelled_key(run),
            keys.deleted_key(run),
            keys.queued_key(run),
            keys.running_key(),
            batch,
            running_field(run, batch),
        )
        return bool(parked)

    def release_staging(self, run: str, batch: str, staging: str) -> bool:
        """Called for a delivery of a superseded staging: its running entry goes only if it
        is that staging's claim. The run's new staging may have claimed its batch of the same
        name since (another worker runs it); deleting that entry would hide it from the
        reaper. True when this call removed the entry."""
        removed = self.client.eval(
            RELEASE_STAGING_SCRIPT, 1, keys.running_key(), running_field(run, batch), staging
        )
        return bool(removed)

    def lost(self, run: str, batch: str) -> int:
        """Called by the reaper for a claimed batch whose lease expired with no output (its
        worker died or vanished): counts the lost delivery; returns how many so far."""
        return int(self.client.hincrby(keys.lost_key(run), batch, 1))

    def unlose(self, running: Running) -> None:
        """Called by the reaper when it could not send a lost batch's order again: the claim
        and the count go back as they were, so the next beat tries again (nothing lost)."""
        self.client.hincrby(keys.lost_key(running.run), running.batch, -1)
        self.client.hset(keys.running_key(), running.field, orjson.dumps(running.entry))

    def poison(self, run: str, batch: str, reason: str) -> None:
        """Called by the reaper once a batch's deliveries were lost `max_deliveries` times:
        it is parked in the failed set as poison (it would crash the fleet one worker at a
        time); the reaper already took its running entry."""
        pipe = self.client.pipeline()
        pipe.hset(keys.failed_key(run), batch, reason[:REASON_MAX_CHARS])
        pipe.srem(keys.queued_key(run), batch)
        pipe.execute()

    def is_poison(self, run: str, batch: str, max_deliveries: int) -> bool:
        """Asked at admission: a stale copy of a batch parked as poison (the broker's
        redelivery after its visibility timeout) must not crash one more worker."""
        return int(self.client.hget(keys.lost_key(run), batch) or 0) >= max_deliveries

    def failed(self, run: str) -> dict[str, str]:
        """The run's failed batches and their last error."""
        return {text(k): text(v) for k, v in self.client.hgetall(keys.failed_key(run)).items()}

    def failed_sample(self, run: str, most: int) -> tuple[dict[str, str], int]:
        """Up to `most` of the run's failed batches with their errors, and how many there are
        (`status`: a run with 4,000 failed batches answers as fast as one with four)."""
        name = keys.failed_key(run)
        count = int(self.client.hlen(name))
        if count <= most:
            return self.failed(run), count
        found = itertools.islice(self.client.hscan_iter(name, count=most), most)
        return {text(k): text(v) for k, v in found}, count

    def unfail_done(self, run: str, done: Collection[str]) -> list[str]:
        """Called by the progress reconcile with the store's listing: a batch in the failed
        set whose output exists (failed by one copy, written by another) is done; returns
        those batches, no longer failed."""
        name = keys.failed_key(run)
        found = [text(k) for k in self.client.hkeys(name) if text(k) in done]
        if found:
            self.client.hdel(name, *found)
        return found

    def clear_failed(self, run: str) -> list[str]:
        """Called by `retry` before it enqueues what lacks an output: each failed batch loses
        its error, its tries and its lost deliveries (a fresh budget) and its queued mark (so
        it is sent again); returns those batches."""
        failed = [text(b) for b in self.client.hkeys(keys.failed_key(run))]
        pipe = self.client.pipeline()
        for batch in failed:
            pipe.hdel(keys.failed_key(run), batch)
            pipe.hdel(keys.attempts_key(run), batch)
            pipe.hdel(keys.lost_key(run), batch)
            pipe.srem(keys.queued_key(run), batch)
        pipe.execute()
        return failed

    # --- kombu's unacknowledged deliveries -------------------------------------------------

    def unacked_orders(self) -> list[Unacked]:
        """Work orders delivered to a worker and not acknowledged (kombu restores them to the
        queue after the visibility timeout): `--resume` counts them as outstanding, the
        reaper finds a dead worker's copy, `delete` drops a run's. One scan of the hash, a
        page of UNACKED_PAGE at a time (a whole-hash reply would hold Redis's one thread)."""
        found: list[Unacked] = []
        for tag, raw in self.client.hscan_iter(keys.UNACKED, count=UNACKED_PAGE):
            try:
                message = orjson.loads(raw)[0]  # [message, exchange, routing key]
            except (ValueError, IndexError, TypeError):
                continue
            order = _work_order(message)
            if order is not None:
                found.append(Unacked(text(tag), str(order["run"]), str(order["batch"]), order))
        return found

    def unacked_index(self) -> UnackedIndex:
        """The delivery tags of unacknowledged orders by batch, for a pass that looks up many
        batches (the reaper's lost ones): the hash is scanned once, at the first lookup."""
        return UnackedIndex(self)

    def drop_unacked(self, tags: Iterable[str]) -> None:
        """Forget deliveries so kombu never restores them (an ack for a dropped tag is a
        no-op): called by the reaper for a copy it replaced or parked."""
        tags = list(tags)
        if tags:
            pipe = self.client.pipeline()
            pipe.hdel(keys.UNACKED, *tags)
            pipe.zrem(keys.UNACKED_INDEX, *tags)
            pipe.execute()

    def redeliver(self, tag: str, queue: str) -> bool:
        """Called by the reaper for a dead worker's copy of an order: moved to the consuming
        end of `queue` (its priority's list), so the next worker to take an order takes it,
        not after every order queued (a new copy would wait there). kombu's own restore of a
        lost delivery, done at once, under a new delivery tag (the old one names the dead
        worker's delivery). False when kombu no longer holds it as read."""
        raw = self.client.hget(keys.UNACKED, tag)
        if raw is None:
            return False
        try:
            message, _exchange, _routing_key = orjson.loads(raw)
            properties = message.setdefault("properties", {})
            message.setdefault("headers", {})["redelivered"] = True  # as kombu marks a restore
            properties.setdefault("delivery_info", {})["redelivered"] = True
            properties["delivery_tag"] = uuid.uuid4().hex
            moved = orjson.dumps(message).decode()
            target = keys.broker_queue_key(queue, properties.get("priority"))
        except (ValueError, TypeError, AttributeError):
            return False
        keys_args = (keys.UNACKED, keys.UNACKED_INDEX, target, tag, text(raw), moved)
        return bool(self.client.eval(REDELIVER_SCRIPT, 3, *keys_args))

    def delivered(self, tag: str, worker: str, presence: str | None) -> None:
        """Called by a worker as it receives a work order (before its admission reads the
        store): whose it is until it is claimed, so that the reaper can give back the order
        of a worker that died first (workers/observe/liveness.py)."""
        entry = {"worker": worker, "presence": presence}
        self.client.hset(keys.delivered_key(), tag, orjson.dumps(entry))

    def deliveries(self) -> dict[str, Delivery]:
        """Delivery tag → to whom (the reaper's pass)."""
        found: dict[str, Delivery] = {}
        for tag, raw in self.client.hgetall(keys.delivered_key()).items():
            with contextlib.suppress(ValueError, KeyError, TypeError):
                entry = orjson.loads(raw)
                found[text(tag)] = Delivery(str(entry["worker"]), entry.get("presence"))
        return found

    def forget_deliveries(self, tags: Collection[str]) -> None:
        """Called by the reaper for deliveries kombu no longer holds (acked, given back)."""
        if tags:
            self.client.hdel(keys.delivered_key(), *tags)

    def purge_unacked(self, run: str) -> set[str]:
        """Called by `delete`: drops every unacknowledged order of `run`, which kombu would
        otherwise restore; returns their batches (those this call removed)."""
        removed: set[str] = set()
        for order in self.unacked_orders():
            if order.run == run and self.client.hdel(keys.UNACKED, order.tag):
                self.client.zrem(keys.UNACKED_INDEX, order.tag)
                removed.add(order.batch)
        return removed


class UnackedIndex:
    """kombu's unacknowledged work orders by (run, batch), read in one scan when first asked
    (`Ledger.unacked_index`): a reaper pass that finds 1,000 dead workers' batches reads the
    hash once, not once per batch. A delivery made after the scan is not in it: the reaper
    asks for a lost batch's copies before it sends the batch again, so what it drops is the
    dead worker's copy, never the new one."""

    def __init__(self, ledger: Ledger) -> None:
        self._ledger = ledger
        self._orders: list[Unacked] | None = None
        self._tags: dict[tuple[str, str], list[str]] = {}

    def orders(self) -> list[Unacked]:
        """Every unacknowledged order, as the one scan found them."""
        if self._orders is None:
            self._orders = self._ledger.unacked_orders()
            for order in self._orders:
                self._tags.setdefault((order.run, order.batch), []).append(order.tag)
        return self._orders

    def copies(self, run: str, batch: str) -> list[str]:
        """Delivery tags of the unacknowledged copies of one batch's order."""
        self.orders()
        return list(self._tags.get((run, batch), ()))

    def carrying(self, order: Mapping[str, Any]) -> list[str]:
        """Delivery tags of the unacknowledged copies that carry exactly `order`."""
        run, batch = str(order.get("run")), str(order.get("batch"))
        return [
            u.tag for u in self.orders() if (u.run, u.batch) == (run, batch) and u.order == order
        ]
