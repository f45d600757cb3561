"""GPU summaries pushed by the workers, read by the power-watch: no broadcast, no timeout.

A broadcast (`inspect gpu_report`) waits for 1,000 replies inside one timeout each beat, and
every reply that misses it is a GPU unseen. Instead each worker pushes its report (what
`gpu_report` returns) every few seconds from a thread of its own, and the beat reads them all
in a few round trips:

    genfleet:summaries   hash worker → its last report (JSON)
    genfleet:pushed      sorted set worker → when it pushed, by Redis's clock (TIME)

Only Redis's clock is compared with itself: a worker whose last push is older than the TTL is
silent (a `worker_unresponsive` finding, with how long it has been silent), and one silent for
FORGET_S is pruned from both keys; a worker that stops cleanly removes itself. Reading them is
`common.summaries`' (the producer reads them too); this module writes and prunes.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import Any

import orjson
import redis

from genfleet.common import engine_alarms, fleet_registry, keys
from genfleet.common.summaries import FORGET_S, Pushed

log = logging.getLogger("genfleet.pushed")

_PUSH = """
local now = redis.call('TIME')
redis.call('HSET', KEYS[1], ARGV[1], ARGV[2])
redis.call('ZADD', KEYS[2], now[1] + now[2] / 1e6, ARGV[1])
redis.call('EXPIRE', KEYS[1], ARGV[3])
redis.call('EXPIRE', KEYS[2], ARGV[3])
return 1
"""


def push(client: Any, worker: str, report: dict[str, Any], forget_s: float = FORGET_S) -> None:
    """Record `worker`'s report, stamped with Redis's time (`client` may be a pipeline). The
    keys themselves expire after `forget_s` without any push: a fleet that is gone leaves
    nothing behind."""
    client.eval(
        _PUSH,
        2,
        keys.summaries_key(),
        keys.pushed_key(),
        worker,
        orjson.dumps(report),
        int(forget_s),
    )


def withdraw(client: redis.Redis, worker: str) -> None:
    """A worker that stops cleanly: not silent, gone."""
    pipe = client.pipeline()
    pipe.hdel(keys.summaries_key(), worker)
    pipe.zrem(keys.pushed_key(), worker)
    pipe.execute()


def prune(client: redis.Redis, found: Pushed) -> None:
    """Forget the workers `common.summaries.read` found silent for its `forget_s`: from both
    keys and the fleet registry. The power-watch is their one pruner, once a beat."""
    if not found.pruned:
        return
    pipe = client.pipeline()
    pipe.zrem(keys.pushed_key(), *found.pruned)
    pipe.hdel(keys.summaries_key(), *found.pruned)
    fleet_registry.forget(pipe, found.pruned)
    engine_alarms.forget(pipe, found.pruned)  # a worker killed outright never cleared its own
    pipe.execute()


class Pusher:
    """A worker's push thread: `report()` every `interval_s`, from the worker's start (its
    engine still loading: `ok: False`) to its stop. A failed push is logged and tried again;
    it never touches the worker."""

    def __init__(
        self,
        client: redis.Redis,
        worker: str,
        report: Callable[[], dict[str, Any]],
        interval_s: float,
    ) -> None:
        self.client = client
        self.worker = worker
        self.report = report
        self.interval_s = interval_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="pusher", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def push_now(self) -> None:
        try:
            push(self.client, self.worker, self.report())
        except (redis.RedisError, OSError) as exc:
            log.warning(
                "GPU summary of %s not pushed (%s): next try in %.0f s",
                self.worker,
                exc,
                self.interval_s,
            )
        except Exception:  # noqa: BLE001 - telemetry never takes the worker down
            log.exception("GPU summary of %s not pushed", self.worker)

    def _loop(self) -> None:
        self.push_now()
        while not self._stop.wait(self.interval_s):
            self.push_now()

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=5)
        try:
            withdraw(self.client, self.worker)
        except redis.RedisError as exc:
            log.warning("could not withdraw the GPU summary of %s: %s", self.worker, exc)


def push_interval_s(watch_interval_s: float, window_s: float, sample_interval_s: float) -> float:
    """Four pushes per power-watch round (or power window, if shorter): the beat judges a
    window at most a quarter old. At most every sample, at least every 30 s.

    >>> push_interval_s(60.0, 60.0, 1.0), push_interval_s(2.0, 3.0, 0.25)
    (15.0, 0.5)
    """
    return min(max(min(watch_interval_s, window_s) / 4, sample_interval_s), 30.0)
