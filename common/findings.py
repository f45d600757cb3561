"""The findings stream: what is wrong with the fleet, as it was found, newest last.

A finding is a JSON object (worker, gpu_uuid, verdict, cause, numbers, suggestion, ts, run)
appended to one bounded Redis stream (`keys.findings_key`), trimmed to about
`findings_maxlen` entries so that a fleet that is wrong for a week holds no more than a
fleet that is wrong for an hour. Three writers make findings, each when it happens:

- the power-watch beat (workers/observe/power_watch.py), for the findings it did not alert
  on lately, in the pipeline that rewrites its alert marks;
- a GPU worker about its own engine (a crash loop, a spent restart budget, a stall:
  workers/runtime.py);
- the supervisor of a node's child workers, when one died and was restarted
  (workers/process/children.py).

`status`, `findings` and the stall reason read them back (producer/status.py). This module
is the only code that touches the stream (tests/test_key_owners.py holds it so).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import orjson
import redis

from genfleet.common import keys


def record(client: redis.Redis, finding: Mapping[str, Any], maxlen: int) -> None:
    """Append `finding`, trimming the stream to about `maxlen` entries. `client` may be a
    pipeline: the power-watch queues its new findings with its alert marks."""
    client.xadd(
        keys.findings_key(),
        {"finding": orjson.dumps(finding)},
        maxlen=maxlen,
        approximate=True,
    )


def recent(client: redis.Redis, count: int = 200) -> list[Any]:
    """The last `count` findings, newest first (an entry without one reads as `{}`)."""
    return [
        orjson.loads((fields or {}).get(b"finding", b"{}"))
        for _id, fields in client.xrevrange(keys.findings_key(), count=count) or []
    ]
