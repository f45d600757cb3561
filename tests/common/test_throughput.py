"""tok/s over a window, for workers younger than the window (a table)."""

from __future__ import annotations

import pytest
import redis

from genfleet.common import keys, throughput
from genfleet.common.throughput import spread

NOW = 1_000.0


@pytest.mark.parametrize(
    ("points", "since", "rates"),
    [
        # a worker 30 s old: its 10-minute figure is its rate over those 30 s
        ([(NOW - 28, "w", 1500), (NOW - 2, "w", 1500)], {"w": NOW - 30}, {"w": 100.0, "": 100.0}),
        # older than the window: the whole window
        ([(NOW - 590, "w", 60000)], {"w": NOW - 5000}, {"w": 100.0, "": 100.0}),
        # start unknown (a worker that stopped answering): the whole window
        ([(NOW - 600, "gone", 6000)], {}, {"gone": 10.0, "": 10.0}),
        # the fleet starts at its oldest worker, or its oldest point if a gone one was older
        (
            [(NOW - 55, "a", 6000), (NOW - 20, "b", 3000)],
            {"a": NOW - 60, "b": NOW - 30},
            {"a": 100.0, "b": 100.0, "": 150.0},
        ),
        (
            [(NOW - 120, "gone", 3000), (NOW - 10, "a", 3000)],
            {"a": NOW - 30},
            {"a": 100.0, "gone": 5.0, "": 50.0},
        ),
        # a worker restarted under the same name 30 s ago: the old process's tokens are the
        # fleet's, not the new worker's (they would inflate its 30 s)
        (
            [(NOW - 300, "w", 30000), (NOW - 10, "w", 3000)],
            {"w": NOW - 30},
            {"w": 100.0, "": 110.0},
        ),
        # a worker started a moment ago: at least one second, never a division by zero
        ([(NOW, "w", 50)], {"w": NOW}, {"w": 50.0, "": 50.0}),
        ([], {"w": NOW - 30}, {}),
    ],
)
def test_spread(
    points: list[tuple[float, str, int]], since: dict[str, float], rates: dict[str, float]
) -> None:
    assert spread(points, NOW, 600.0, since) == pytest.approx(rates)


@pytest.mark.integration
def test_tokens_go_into_buckets_read_in_a_few_calls(redis_client: redis.Redis) -> None:
    """Reports add to ten-second buckets (real Redis): a window's tok/s counts the buckets
    inside it, the oldest one for its share, and each bucket expires by itself."""
    now = 10_000.0  # a bucket boundary
    pipe = redis_client.pipeline()
    for ts, worker, tokens in [
        (now - 125, "a", 9000),  # before a 120 s window
        (now - 115, "a", 1200),  # its bucket [now-120, now-110) is wholly inside
        (now - 15, "b", 600),
        (now - 1, "a", 600),
        (now - 1, "b", 600),
    ]:
        throughput.add(pipe, "r", worker, tokens, ts)
    pipe.execute()
    redis_client.sadd(keys.runs_key(), "r")

    assert throughput.run_tokens_per_s(redis_client, "r", now, 120.0) == pytest.approx(25.0)
    # 5 s later: the oldest bucket (now-115's) half inside the window, the newest whole
    assert throughput.run_tokens_per_s(redis_client, "r", now + 5, 120.0) == pytest.approx(
        (1200 * 0.5 + 600 + 1200) / 120
    )
    rates = throughput.fleet_tokens_per_s(redis_client, now, 120.0)
    assert rates == pytest.approx({"a": 15.0, "b": 10.0, "": 25.0})
    bucket = keys.throughput_bucket_key("r", throughput.bucket_of(now - 1))
    assert 0 < redis_client.pttl(bucket) <= (throughput.KEEP_S + throughput.BUCKET_S) * 1000
