"""Output tokens per second from Redis, for a run, a worker or the whole fleet.

Each finished batch adds `ts:batch:worker:tokens` to its run's throughput sorted set (score =
ts, trimmed to an hour), so any window up to an hour can be summed without a time series
database. Coarse (one point per batch) but exact over windows longer than a batch.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable, Mapping

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


def spread(
    points: Iterable[tuple[float, str, int]],
    now: float,
    window_s: float,
    since: Mapping[str, float] | None = None,
) -> dict[str, float]:
    """tok/s per worker and for the fleet (""), each over the part of the window it existed.

    `points` are (ts, worker, tokens) in the window; `since` maps worker → when it started
    generating. A worker up for 30 s is averaged over those 30 s, not over a ten-minute window
    of which most precede it, and its points from before it started (an earlier process of the
    same name) are not its own. A worker whose start is unknown is averaged over the whole
    window. The fleet counts every point, from its oldest worker's start or its oldest point,
    whichever is earlier.
    """
    since = since or {}
    tokens: dict[str, int] = defaultdict(int)
    earliest: float | None = None
    for ts, worker, count in points:
        tokens[""] += count
        earliest = ts if earliest is None else min(earliest, ts)
        if ts >= since.get(worker, float("-inf")):
            tokens[worker] += count
    rates: dict[str, float] = {}
    for worker, count in tokens.items():
        if worker:
            start = since.get(worker)
        else:
            starts = [*since.values(), *([earliest] if earliest is not None else [])]
            start = min(starts) if starts else None
        span = window_s if start is None else min(window_s, now - start)
        rates[worker] = count / max(span, 1.0)
    return rates


def fleet_tokens_per_s(
    client: redis.Redis, now: float, window_s: float, since: Mapping[str, float] | None = None
) -> dict[str, float]:
    """tok/s over the last `window_s` per worker, plus the fleet total under "" (all runs);
    `since` (worker → start) shortens the span of workers younger than the window."""
    points: list[tuple[float, str, int]] = []
    for run in client.smembers(keys.runs_key()):
        found: list[tuple[bytes, float]] = client.zrangebyscore(  # type: ignore[assignment]
            keys.throughput_key(text(run)), now - window_s, "+inf", withscores=True
        )
        points += [(float(score), *_parse(raw)) for raw, score in found]
    return spread(points, now, window_s, since)
