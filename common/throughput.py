"""Output tokens per second from Redis, for a run, a worker or the whole fleet.

Each finished batch adds `ts:batch:worker:tokens` to its run's throughput sorted set (score =
ts, trimmed to an hour), so any window up to an hour can be summed without a time series
database. Coarse (one point per batch) but exact over windows longer than a batch.
"""

from __future__ import annotations

from collections import defaultdict

import redis

from genfleet.common import keys
from genfleet.common.redis_conn import text


def member(ts: float, batch: str, worker: str, tokens: int) -> str:
    return f"{ts:.3f}:{batch}:{worker}:{tokens}"


def _parse(raw: object) -> tuple[str, int]:
    parts = text(raw).split(":")
    worker = parts[2] if len(parts) >= 4 else ""
    return worker, int(parts[-1])


def run_tokens_per_s(
    client: redis.Redis, run: str, now: float, window_s: float, started_at: float | None = None
) -> float:
    """A run's tok/s over the last `window_s` (or since it started, if that is shorter)."""
    window = window_s
    if started_at:
        window = max(min(window_s, now - started_at), 1.0)
    members = client.zrangebyscore(keys.throughput_key(run), now - window, "+inf")
    return sum(_parse(m)[1] for m in members) / window


def fleet_tokens_per_s(client: redis.Redis, now: float, window_s: float) -> dict[str, float]:
    """tok/s over the last `window_s` per worker, plus the fleet total under "" (all runs)."""
    totals: dict[str, float] = defaultdict(float)
    for run in client.smembers(keys.runs_key()):
        for raw in client.zrangebyscore(keys.throughput_key(text(run)), now - window_s, "+inf"):
            worker, tokens = _parse(raw)
            totals[worker] += tokens / window_s
            totals[""] += tokens / window_s
    return dict(totals)
