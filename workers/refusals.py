"""The runs a worker judged against its model: what it remembers of each verdict.

A worker judges a run's model once per run and staging (`common.model_identity.judge`: one
store read) and remembers the verdict here: a run it serves for as long as it lives (the
record is write-once and the worker's model does not change), a run it refused for `memory_s`
(`refused_run_memory_s`), after which the next order of it is judged again. While it
remembers a refusal, the run's orders go back to the end of their queue at once, with no
store read (`workers.admission`: the batch slot that handed one back then rests
`refused_order_rest_s`, so that no queue goes round in a hot loop).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

from genfleet.common.model_identity import Verdict


class RunVerdicts:
    """Verdicts by (run, staging), shared by the worker's batch threads."""

    def __init__(self, memory_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.memory_s = memory_s
        self._clock = clock
        self._lock = threading.Lock()
        self._served: dict[tuple[str, str], Verdict] = {}
        self._refused: dict[tuple[str, str], tuple[Verdict, float]] = {}  # until

    def known(self, run: str, staging: str) -> Verdict | None:
        """The verdict remembered for the run's staging; None: judge it (again)."""
        with self._lock:
            served = self._served.get((run, staging))
            if served is not None:
                return served
            refused = self._refused.get((run, staging))
            if refused is None or refused[1] <= self._clock():
                return None
            return refused[0]

    def remember(self, run: str, staging: str, verdict: Verdict) -> bool:
        """Keep `verdict`; True when no other batch thread remembered one for the run's
        staging in the meantime. Several slots can judge the same run at once (each found
        nothing known): only the first says what it found, once, not once per slot."""
        with self._lock:
            now = self._clock()
            self._refused = {k: v for k, v in self._refused.items() if v[1] > now}
            key = (run, staging)
            first = key not in self._served and key not in self._refused
            if verdict.serves:
                self._served[key] = verdict
                self._refused.pop(key, None)
            else:
                self._refused[key] = (verdict, now + self.memory_s)
            return first
