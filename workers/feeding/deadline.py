"""How long one request may take: its token budget at the pace the engine actually runs.

A fixed deadline for every request is wrong both ways: a 32K-token thinking completion at
10 tok/s per sequence (a loaded engine) needs close to an hour, a 1K-token one a minute. So
the feeder gives each request a deadline of its own, from its `max_tokens` and the
per-sequence pace the worker measured on its engine's recent completions (tokens / latency
of each, queueing included), never faster than it is, never slower than a floor:

    request_deadline_s(8192, 40.0, base_s=600, min_tokens_per_s=2, margin=2)   # 1009.6
    request_deadline_s(32768, 10.0, base_s=600, min_tokens_per_s=2, margin=2)  # 7153.6
    request_deadline_s(8192, None, base_s=600, min_tokens_per_s=2, margin=2)   # 8792 (floor)

A request past its deadline is that prompt's failure (an error record), never its batch's.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any


def request_deadline_s(
    max_tokens: int,
    tokens_per_s: float | None,
    *,
    base_s: float,
    min_tokens_per_s: float,
    margin: float,
) -> float:
    """`base_s + max_tokens / max(min_tokens_per_s, tokens_per_s) × margin`.

    `base_s` covers what does not grow with the answer (connecting, prefill); the margin
    covers a pace that drops as the engine fills. `tokens_per_s` None: nothing measured yet,
    the floor alone."""
    pace = max(min_tokens_per_s, tokens_per_s or 0.0)
    return base_s + max(max_tokens, 0) / pace * margin


def max_tokens_of(params: Mapping[str, Any] | None, run_max_tokens: int) -> int:
    """The token budget one request asks for: its own `max_tokens` (or OpenAI's
    `max_completion_tokens`) when its line set one, else the run's."""
    own = params or {}
    for name in ("max_tokens", "max_completion_tokens"):
        value = own.get(name)
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            return value
    return run_max_tokens


@dataclass(frozen=True, slots=True)
class DeadlinePolicy:
    """The settings of `request_deadline_s` (`request_timeout_s`, `request_min_tokens_per_s`,
    `request_deadline_margin`)."""

    base_s: float
    min_tokens_per_s: float
    margin: float

    def deadline_s(self, max_tokens: int, tokens_per_s: float | None) -> float:
        return request_deadline_s(
            max_tokens,
            tokens_per_s,
            base_s=self.base_s,
            min_tokens_per_s=self.min_tokens_per_s,
            margin=self.margin,
        )


class SequencePace:
    """The per-sequence pace of the engine's recent completions, in tokens per second.

    Each completion of at least `min_tokens` adds tokens / latency (short answers measure
    prefill and queueing, not decoding); `tokens_per_s()` is a low quantile of the last
    `size`, so a deadline follows the slow end of what the engine does now, not its mean.
    """

    def __init__(self, size: int = 256, min_tokens: int = 32, quantile: float = 0.1) -> None:
        self.min_tokens = min_tokens
        self.quantile = quantile
        self._rates: deque[float] = deque(maxlen=size)

    def add(self, completion_tokens: int, latency_s: float) -> None:
        if completion_tokens >= self.min_tokens and latency_s > 0:
            self._rates.append(completion_tokens / latency_s)

    def tokens_per_s(self) -> float | None:
        if not self._rates:
            return None
        ranked = sorted(self._rates)
        return ranked[min(int(len(ranked) * self.quantile), len(ranked) - 1)]
