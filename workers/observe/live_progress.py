"""A worker's live progress: the prompts and tokens its running batches generated, sent to
Redis in one pipeline per interval for all of them.

`status`, `top` and the tok/s buckets move while batches run, not only when one finishes; a
point from every running batch every two seconds would be thousands of writes a second on a
fleet of 1,000 workers running several batches each. So each batch adds what finished to its
worker's `ProgressTally`, and the tally is written (`Ledger.progress`) at most once an
`interval_s` by whichever of the worker's batch threads comes by first, plus once when a
batch ends, so that nothing a finished batch generated waits for another batch. The figures
are at most one interval behind, as they were with a point per batch.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

import redis

from genfleet.common.ledger import Ledger
from genfleet.common.redis_conn import RedisCommands, server_time

log = logging.getLogger("genfleet.batch")

# How often a worker writes its running batches' progress (prompts and tokens so far).
PROGRESS_INTERVAL_S = 2.0


class ProgressTally:
    """What a worker's batches generated since the tally was last written, by run; shared
    by the worker's batch threads (one per worker process, `WorkerRuntime.progress`)."""

    def __init__(
        self,
        interval_s: float = PROGRESS_INTERVAL_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.interval_s = interval_s
        self._clock = clock
        self._lock = threading.Lock()
        self._pending: dict[str, list[int]] = {}  # run → [prompts, tokens]
        self._written_at = clock()

    def add(self, run: str, prompts: int, tokens: int) -> None:
        """Count `prompts` and their completion `tokens` as generated for `run`."""
        if not prompts and not tokens:
            return
        with self._lock:
            counts = self._pending.setdefault(run, [0, 0])
            counts[0] += prompts
            counts[1] += tokens

    def report(self, client: RedisCommands, worker: str, now_due: bool = False) -> bool:
        """Write what was added, in one pipeline, when `interval_s` has passed since the last
        write (or `now_due`: a batch ended). On a Redis failure the counts stay for the next
        write. True when this call wrote."""
        with self._lock:
            if not now_due and self._clock() - self._written_at < self.interval_s:
                return False
            taken, self._pending = self._pending, {}
            self._written_at = self._clock()
        if not taken:
            return False
        try:
            counts = {run: (prompts, tokens) for run, (prompts, tokens) in taken.items()}
            # Tokens go to the ten-second bucket of Redis's clock, which `status` reads by.
            Ledger(client).progress(worker, counts, server_time(client))
        except redis.RedisError as exc:
            for run, (prompts, tokens) in taken.items():
                self.add(run, prompts, tokens)
            log.warning("progress of %s not reported (%s): kept", ", ".join(taken), exc)
            return False
        return True
