"""How many work orders wait in a queue: the lengths of its broker lists (one per priority
step, `keys.broker_queue_keys`), read in one pipeline, no message read.

Read by the power-watch (is work waiting while an engine has room?), a worker whose engine
died (hand its batches back only where no order waits), the lost-order reconciler and
`genfleet status`.
"""

from __future__ import annotations

from collections.abc import Iterable

import redis

from genfleet.common import keys


def orders_waiting(client: redis.Redis, queues: Iterable[str]) -> int:
    """The orders waiting in all of `queues`."""
    pipe = client.pipeline()
    for queue in queues:
        for name in keys.broker_queue_keys(queue):
            pipe.llen(name)
    return sum(int(n) for n in pipe.execute())


def queue_depth(client: redis.Redis, queue: str) -> int:
    """The orders waiting in `queue`."""
    return orders_waiting(client, (queue,))
