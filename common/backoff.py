"""Exponential backoff: the one rule for how long a retry waits, with each user's numbers.

    >>> PROMPT_RETRY.delay_s(1), PROMPT_RETRY.delay_s(6)   # a prompt's try, engine down
    (0.5, 10.0)
    >>> BATCH_RETRY.delay_s(1), BATCH_RETRY.delay_s(9)     # a batch's try, held under its lease
    (2.0, 60.0)
    >>> Backoff(base_s=2.0).delay_s(3)                     # no cap: a child worker's restart
    16.0

`jitter=0.2` spreads waits over ±20 %, so that prompts the engine pushed back on together do
not all come back together. The exponent stops growing once the cap is reached (no float
overflow after a thousand refusals).
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable
from dataclasses import dataclass

_MAX_EXPONENT = 64  # 2**64 times any base in use is past every cap


@dataclass(frozen=True)
class Backoff:
    """`base_s * 2**attempt` seconds, at most `cap_s`, scaled by a random factor in
    [1 - jitter, 1 + jitter]."""

    base_s: float
    cap_s: float = math.inf
    jitter: float = 0.0

    def delay_s(
        self, attempt: int, uniform: Callable[[float, float], float] = random.uniform
    ) -> float:
        delay = min(self.base_s * 2.0 ** min(attempt, _MAX_EXPONENT), self.cap_s)
        if self.jitter:
            delay *= uniform(1.0 - self.jitter, 1.0 + self.jitter)
        return delay


# A prompt's failed try (engine down, abort, 5xx): 0.5, 1, 2, 4, 8, then 10 s at most; the
# supervisor's own restart backoff runs meanwhile.
PROMPT_RETRY = Backoff(base_s=0.25, cap_s=10.0)
# A prompt the engine called busy (429, queue full) without a Retry-After.
BUSY = Backoff(base_s=0.25, cap_s=10.0, jitter=0.2)
# A batch's failed try, waited out by its worker under the batch's lease: 2, 4, ... 60 s.
BATCH_RETRY = Backoff(base_s=1.0, cap_s=60.0)
# Writing a finished batch's output while the store is unreachable: 2, 4, 8, 16 s.
OUTPUT_WRITE = Backoff(base_s=1.0, cap_s=30.0)
# Redis bookkeeping after a batch's output exists: 1, 2, 4 s.
BOOKKEEPING = Backoff(base_s=0.5)
