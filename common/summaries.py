"""The GPU summaries workers push to Redis, as their readers see them.

Each worker pushes its report every few seconds (`workers/observe/pushed.py` writes them):

    genfleet:summaries   hash worker → its last report (JSON)
    genfleet:pushed      sorted set worker → when it pushed, by Redis's clock (TIME)

Two readers: the power-watch (its samples, the nodes still starting, the silent workers) and
the producer (which workers are still loading their engine, and for which queue, so that a
run is not told no worker serves it while one loads). Only Redis's clock is compared with
itself: a report older than the TTL is silence, one older than FORGET_S is gone (the
power-watch prunes it). Reading writes nothing.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import orjson
import redis

from genfleet.common import keys
from genfleet.common.redis_conn import text

# A worker silent this long has gone for good: it leaves the registry and stops being a finding.
FORGET_S = 600.0


@dataclass
class Pushed:
    """What was read: reports of workers heard within the TTL whose engine is up (`samples`)
    or still starting (`starting`: `ok: false`, with the node and the queue it will consume),
    the silent workers with how long they have been silent, and those gone (`pruned`: silent
    for FORGET_S, for the power-watch to remove)."""

    samples: dict[str, dict[str, Any]] = field(default_factory=dict)
    starting: dict[str, dict[str, Any]] = field(default_factory=dict)
    silent_s: dict[str, float] = field(default_factory=dict)
    pruned: list[str] = field(default_factory=list)

    @property
    def starting_nodes(self) -> set[str]:
        """The nodes of the workers still starting: their GPUs are not unclaimed."""
        return {str(r["node"]) for r in self.starting.values() if r.get("node")}

    def loading(self) -> dict[str, str]:
        """Worker → the queue it will consume once its engine is up, for those starting."""
        return {w: r["queue"] for w, r in self.starting.items() if isinstance(r.get("queue"), str)}


def read(client: redis.Redis, ttl_s: float, forget_s: float = FORGET_S) -> Pushed:
    """Every worker's last push, judged by Redis's clock (three round trips, no writes)."""
    seconds, micros = client.time()
    now = float(seconds) + float(micros) / 1e6
    pipe = client.pipeline(transaction=False)
    pipe.zrangebyscore(keys.pushed_key(), "-inf", now - forget_s)
    pipe.zrangebyscore(keys.pushed_key(), now - forget_s, "+inf", withscores=True)
    pipe.hgetall(keys.summaries_key())
    gone, heard, reports = pipe.execute()
    found = Pushed(pruned=sorted(text(w) for w in gone))
    raw = {text(k): v for k, v in reports.items()}
    for member, score in heard:
        worker = text(member)
        age_s = max(now - float(score), 0.0)
        if age_s > ttl_s or worker not in raw:
            found.silent_s[worker] = round(age_s, 1)
            continue
        try:
            report = orjson.loads(raw[worker])
        except orjson.JSONDecodeError:
            found.silent_s[worker] = round(age_s, 1)  # a report that cannot be read is none
            continue
        if not isinstance(report, dict):
            found.silent_s[worker] = round(age_s, 1)
        elif report.get("ok", True) is not False:
            found.samples[worker] = report
        else:
            found.starting[worker] = report
    return found
