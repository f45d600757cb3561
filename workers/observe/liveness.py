"""Whether a worker process is alive, as Redis sees it: its named connection.

A lease says a batch is alive; it lapses only a lease after its worker died, and the reaper
waits half a lease more to be sure. A worker's death is known to Redis at once, though: the
kernel closes a dead process's sockets, and Redis drops its connections. So every GPU worker
keeps one connection named after itself (`CLIENT SETNAME genfleet-worker:<hostname>`), pinged
every third of a lease (`Presence`), and the control worker's reaper reads the names Redis has
(`present`, one `CLIENT LIST`) to tell a dead worker's work from a live one's:

- a claimed batch whose worker has no connection is reaped without waiting for its lease;
- an order delivered to a worker and not claimed yet (received, its admission still reading
  the store) has no lease at all; its owner is recorded at delivery (the ledger's
  `delivered`), and when that owner has no connection the order goes back to the queue
  instead of waiting for the broker's visibility timeout (hours).

Absence counts only when seen twice, half a lease apart (`reaper.lapse_confirmed`): a live
worker's connection is back within a ping after a Redis restart or `CLIENT KILL`. A worker
whose connection could not be named (an ACL without `CLIENT SETNAME`) claims without a name
and is judged by its lease alone; a reaper that may not run `CLIENT LIST` judges every batch
by its lease, as before.
"""

from __future__ import annotations

import logging
import threading

import redis

from genfleet.common.redis_conn import text

log = logging.getLogger("genfleet.worker")

PREFIX = "genfleet-worker:"


def connection_name(hostname: str) -> str:
    """The name of worker `hostname`'s connection (Redis refuses spaces in a name)."""
    return PREFIX + "".join("_" if c.isspace() else c for c in hostname)


def present(client: redis.Redis) -> set[str] | None:
    """The named worker connections Redis holds now on the client's database; None when the
    client may not list them (then nobody is judged by presence)."""
    try:
        clients = client.client_list(_type="normal")
    except redis.ResponseError as exc:
        log.warning("CLIENT LIST refused (%s): workers are judged by their leases only", exc)
        return None
    db = client.connection_pool.connection_kwargs.get("db", 0)
    return {
        text(c.get("name"))
        for c in clients
        if text(c.get("name", "")).startswith(PREFIX) and int(c.get("db", db)) == int(db)
    }


class Presence:
    """A worker's named connection, pinged every `interval_s` by a daemon thread so that Redis
    holds it while the worker lives (and again within a ping after Redis restarts).

    `name` is the connection's name once it is known to be set, else None: a worker claims
    batches under it (`Ledger.claim`), and the reaper judges only named claims by presence.
    """

    def __init__(self, client: redis.Redis, hostname: str, interval_s: float) -> None:
        self.client = client
        self.wanted = connection_name(hostname)
        self.interval_s = interval_s
        self.name: str | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="presence", daemon=True)

    def start(self) -> None:
        self._ping()
        self._thread.start()

    def _ping(self) -> None:
        try:
            self.client.ping()
            self.name = self.wanted
        except redis.ResponseError as exc:  # SETNAME refused: the lease alone tells
            if self.name is None:
                log.warning("connection not named (%s): batches judged by their leases", exc)
        except redis.RedisError:
            pass  # Redis away: the next ping reconnects

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            self._ping()

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=self.interval_s + 5)
        self.client.close()
