"""A broker blip costs nothing already done: running batches keep running across a reconnect.

Celery's default on a lost broker connection is to close the channel, which on Redis puts every
message the worker holds back in the queue (kombu's `QoS.restore_unacked_once`) while the
batches still run: a second copy of each, or, with
`worker_cancel_long_running_tasks_on_connection_loss`, every completion in flight thrown away.
When Redis is down at that moment the restore fails instead, and the closed channel can no
longer ack: each order comes back only after the visibility timeout, hours later.

So here, when the connection is lost (`Consumer.on_connection_error_after_connected`), the
deliveries of the batches the worker holds are taken off the old channel (nothing restores them:
they are not lost, they run), and when the consumer connects again (`Consumer.connect`) they are
given the new channel, counted there as delivered (the prefetch limit holds). A batch that ends
meanwhile waits for that (`BatchRequest` calls `wait_for_channel`) and acks, or hands back, on
the new channel: the broker's copy of the order (kombu's unacked hash, kept across a Redis
restart by its AOF) is removed there.

A task that ended just before the connection was lost has its ack (or hand-back) queued on the
consumer's event loop (Celery's `call_soon_ack`), not yet done: the loop runs it after the
reconnect, and on the old channel, whose connection is gone, it raised (`'NoneType' object has
no attribute 'client'`), an unrecoverable error that ended the worker (the chaos soak's control
worker, its reaper with it, at a Redis restart). Those messages are moved to the new channel
too (`queued_on`), so the queued ack is done there.

The consumer's prefetch count is new after a reconnect, at its initial value: the slots the
worker's running batches handed on (`workers.process.slots`) are counted on it as the event
loop starts (`Consumer.loop_args`), or the batches moved to the new channel would fill it and
the worker would take nothing more until they all ended.
"""

from __future__ import annotations

import logging
import threading
import time
import weakref
from collections.abc import Callable
from typing import Any

from celery.worker.consumer import Consumer as CeleryConsumer
from celery.worker.request import Request

from genfleet.workers.context import BatchTask

log = logging.getLogger("genfleet.worker")

# How long a finished batch waits for the broker to come back before it gives up acking: the
# broker then delivers the order again after its visibility timeout, and that copy finds the
# output and is skipped. Longer than a blip, shorter than anyone would wait on one thread.
ACK_WAIT_S = 600.0


# Acks and hand-backs the consumer's own thread was asked for while the broker was away (a
# request revoked or expired before it ran): done by `Consumer.connect` once it reconnected.
_deferred: list[Callable[[], object]] = []


def defer(action: Callable[[], object]) -> None:
    _deferred.append(action)


# Requests whose ack or hand-back was queued on the consumer's event loop (`HeldRequest`
# records them as it queues it): kombu has done it once their message says acknowledged.
_queued: weakref.WeakSet[HeldRequest] = weakref.WeakSet()
_queued_lock = threading.Lock()


def queued(request: HeldRequest) -> None:
    with _queued_lock:
        _queued.add(request)


def queued_on(channel: Any, requests: Any = None) -> list[HeldRequest]:
    """The requests (by default every one recorded) whose ack or hand-back waits on the
    consumer's event loop, to be done on `channel`: when the connection is lost, the loop
    would do it on a channel with no connection."""
    if requests is None:
        with _queued_lock:
            requests = tuple(_queued)
    return [
        r
        for r in requests
        if r.message is not None and not r.message.acknowledged and r.message.channel is channel
    ]


def held_requests(requests: Any) -> list[HeldRequest]:
    """The requests of the tasks this worker holds (batches, the control worker's beat tasks;
    running or waiting on a pool thread) whose messages are neither acked nor handed back."""
    return [
        r
        for r in tuple(requests)
        if isinstance(r, HeldRequest) and not r.acknowledged and r.message is not None
    ]


def still_running(request: HeldRequest, requests: Any) -> bool:
    """Whether a held request still holds a prefetch slot when the broker is back: a batch's
    (a beat task stuck on the outage must not keep the worker from taking the next ones)
    that still runs. One that ended meanwhile acks or hands back at once on the new channel;
    counting it would keep its slot for good if that never came (its end failed first)."""
    return request.counts_against_prefetch and request in requests and not request.acknowledged


class HeldRequest(Request):  # type: ignore[misc]
    """A request of a genfleet task (every one is acked late) that outlives a broker blip:
    it keeps running across the reconnect and acks, or hands back, on the new channel
    (above)."""

    # Whether the request holds a prefetch slot on the new channel (a batch's does; a beat
    # task stuck on the outage must not keep the worker from taking the next orders).
    counts_against_prefetch = False

    def acknowledge(self) -> None:
        if self._on_the_broker("ack", lambda: Request.acknowledge(self)):
            if not self.acknowledged:
                queued(self)
            super().acknowledge()

    def reject(self, requeue: bool = False) -> None:
        later = lambda: Request.reject(self, requeue=requeue)  # noqa: E731
        if self._on_the_broker("hand back" if requeue else "reject", later):
            if not self.acknowledged:
                queued(self)
            super().reject(requeue=requeue)

    def _on_the_broker(self, what: str, later: Any) -> bool:
        """Wait for a channel to `what` the message on (after a broker blip the task kept
        running, `workers.process.reconnect`); False, and the message is left to the broker's
        redelivery, when the broker did not come back in time. The consumer's own thread
        (a request revoked or expired before it ran) never waits: it is the one that
        reconnects, so the action is done (`later`) once it has."""
        acknowledged: bool = self.acknowledged  # type: ignore[has-type]
        if acknowledged or self.message.channel is not None:
            return True
        if threading.current_thread() is threading.main_thread():
            defer(later)
            return False
        if wait_for_channel(self.message):
            return True
        log.error(
            "%s: the broker did not come back, could not %s the message; it is delivered again "
            "after the visibility timeout (a finished batch is then skipped)",
            self.id,
            what,
        )
        self.acknowledged = True
        return False


class Consumer(CeleryConsumer):  # type: ignore[misc]
    """Celery's consumer, keeping the worker's batches across a reconnect (see above)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.orphans: list[HeldRequest] = []  # held, with no channel until the next connect

    def on_connection_error_after_connected(self, exc: Exception) -> None:
        from celery.worker.state import reserved_requests

        channel = _default_channel(self.connection)
        detached = 0
        waiting = queued_on(channel) if channel is not None else []
        for request in [*held_requests(reserved_requests), *waiting]:
            message = request.message
            if message.channel is not None and message.channel is channel:
                channel.qos._delivered.pop(message.delivery_tag, None)
                detached += 1
            message.channel = None
            if all(request is not r for r in self.orphans):
                self.orphans.append(request)
        if channel is not None:
            # What is still delivered on the old channel runs nowhere here: an ack or a hand-back
            # that failed with the connection. kombu restores it when the channel closes — a
            # second copy in the queue or, with Redis away, a crash of the whole worker (its
            # restore opens a connection that is gone). Its copy in the broker's unacked hash
            # comes back after the visibility timeout instead (a batch whose output exists is
            # then skipped).
            channel.qos._delivered.clear()
        if self.orphans:
            log.warning(
                "broker connection lost: %d tasks keep running (%d taken off the old "
                "channel), acked on the new connection",
                len(self.orphans),
                detached,
            )
        super().on_connection_error_after_connected(exc)

    def connect(self) -> Any:
        from celery.worker.state import reserved_requests

        connection = super().connect()
        if self.orphans:
            channel = connection.default_channel
            for request in self.orphans:
                request.message.channel = channel
                # A batch that still runs counts as delivered on the new channel, so the
                # prefetch limit still holds: otherwise the worker takes a full prefetch more
                # while its batches run, and orders it cannot start yet would wait, unclaimed,
                # on a worker that may die.
                if still_running(request, reserved_requests):
                    channel.qos._delivered[request.message.delivery_tag] = request.message
            log.info("broker connection back: %d running tasks moved to it", len(self.orphans))
            self.orphans = []
        while _deferred:
            action = _deferred.pop(0)
            try:
                action()
            except Exception:  # noqa: BLE001 - one message's ack must not stop the consumer
                log.exception("a deferred ack failed: the broker delivers that message again")
        return connection

    def loop_args(self) -> Any:
        """The event loop's arguments, once the consumer (re)connected and made its prefetch
        count: the slots handed on by the batches that still run are counted on it first."""
        runtime = BatchTask.runtime
        if runtime is not None:
            runtime.consumer_started(self.qos)
        return super().loop_args()


def _default_channel(connection: Any) -> Any:
    """The connection's channel if it has one already (never opens one)."""
    return getattr(connection, "_default_channel", None) if connection is not None else None


def wait_for_channel(message: Any, timeout_s: float = ACK_WAIT_S, poll_s: float = 0.2) -> bool:
    """Block until `message` has an open channel to ack on (True), or `timeout_s` passes or
    the worker is stopping (False: a stopping worker must not hang on a broker that is down;
    the batch's lease lapses and the reaper sends its order again)."""
    from celery.worker import state

    deadline = time.monotonic() + timeout_s
    while message.channel is None or getattr(message.channel, "closed", False):
        stopping = state.should_stop is not None or state.should_terminate is not None
        if stopping or time.monotonic() > deadline:
            return False
        time.sleep(poll_s)
    return True
