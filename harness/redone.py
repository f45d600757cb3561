"""Generated tokens that did not end up in a kept answer, charged to the fault that threw them
away: the tokens a soak's faults cost, beside the prompts they sent again (`harness/resends.py`).

An answer may take several requests (tries). After a cut the next try goes on from the output
ids the worker still has (`drawn` in the request log): all that the cut try streamed (an engine
that died), fewer (a lost worker's answers go on from their checkpoint), or none (an answer
that starts over). Token `p` of a try is kept when no later try of the answer starts at or
before `p`: a try that started at `k` and generated `g` keeps `min(g, k' - k)`, clipped at 0,
`k'` the least start among the tries after it; the last try keeps all it generated. The rest
is redone, charged to the last fault between the try and the answer's next one that hit its
worker, else the last that hit the whole fleet, else `unexplained` (two copies of a batch at
once): a try is sent again because of the first fault that cut it, but what it loses is what
the last one left (an engine frozen, then its worker killed before the watchdog's kill: the
worker's SIGKILL took the ids it held).

What a try generated is its `end` line's count. A try its engine died with has no end line:
what all such tries of one engine process generated is that process's tokens file (the
emulator's `tokens_file`, rewritten at every step) less its ended tries, and they share what
they redid by their causes. So the total is exact: every engine's tokens less what the kept
answers hold, which is what the exported records count (`usage.completion_tokens`).
"""

from __future__ import annotations

import collections
import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from harness.chaos import Played
from harness.resends import UNEXPLAINED, Send, breaking, cause_of, worker_of

Process = tuple[str, int]  # (worker, engine pid)


def engine_tokens(root: Path) -> dict[Process, int]:
    """The output tokens each engine process of the soak in `root` stepped so far, from the
    tokens files beside the request logs (`requests-<worker>.jsonl.<pid>.tokens`)."""
    found: dict[Process, int] = {}
    for path in root.glob("requests-*.jsonl.*.tokens"):
        pid = int(path.name.rsplit(".", 2)[1])
        text = path.read_bytes().strip()
        found[(worker_of(path), pid)] = int(text) if text else 0
    return found


def since(now: Mapping[Process, int], before: Mapping[Process, int]) -> dict[Process, int]:
    """What each engine process stepped between two reads of `engine_tokens`."""
    return {proc: tokens - before.get(proc, 0) for proc, tokens in now.items()}


@dataclass
class Redone:
    """Tokens redone by cause, and the tokens the tries' answers kept."""

    by_cause: collections.Counter[str] = field(default_factory=collections.Counter)
    kept: int = 0
    # Tokens of engines that died with tries in flight beyond what those tries could have
    # generated: never expected; shown, never hidden, should a log lose a line.
    inconsistent: int = 0

    @property
    def total(self) -> int:
        return sum(self.by_cause.values())


def redone_tokens(
    answers: Iterable[Sequence[Send]],
    ended: Mapping[str, int],
    generated: Mapping[Process, int],
    faults: Sequence[Played],
) -> Redone:
    """The tokens of `answers` (each answer's tries) that no kept answer holds, by cause (see
    the module's docstring). `ended`: what each ended try generated, by its request id;
    `generated`: what each engine process generated over the same window.

    >>> kill = Played(10.0, "kill_worker", "w1")
    >>> tries = [Send(1.0, "w1", 7, "a", 0), Send(12.0, "w2", 8, "b", 40)]
    >>> out = redone_tokens([tries], {"b": 60}, {("w1", 7): 55, ("w2", 8): 60}, [kill])
    >>> dict(out.by_cause), out.kept
    ({'kill_worker': 15}, 100)
    """
    causes = breaking(faults)
    result = Redone()
    ended_in: collections.Counter[Process] = collections.Counter()
    died_kept: collections.Counter[Process] = collections.Counter()
    died_causes: dict[Process, collections.Counter[str]] = collections.defaultdict(
        collections.Counter
    )
    for tries in answers:
        ordered = sorted(tries, key=lambda t: t.at_s)
        for i, one in enumerate(ordered):
            after = ordered[i + 1 :]
            start_next = min((t.drawn for t in after), default=None)
            why = cause_of(one, after[0].at_s if after else math.inf, causes, last=True)
            proc = (one.worker, one.pid)
            carried = 0 if start_next is None else max(0, start_next - one.drawn)
            tokens = ended.get(one.rid) if one.rid is not None else None
            if tokens is None:  # its engine died with it
                died_kept[proc] += carried
                died_causes[proc][why] += 1
                result.kept += carried
                continue
            kept = tokens if start_next is None else min(tokens, carried)
            ended_in[proc] += tokens
            result.kept += kept
            if tokens > kept:
                result.by_cause[why] += tokens - kept
    for proc in set(ended_in) | set(died_causes):
        if proc not in generated:
            raise ValueError(f"no tokens file for engine process {proc}: its tokens are unknown")
    for proc, tokens in generated.items():
        lost = tokens - ended_in[proc] - died_kept[proc]
        if lost < 0:
            result.inconsistent += -lost
            continue
        _share(result.by_cause, lost, died_causes.get(proc) or collections.Counter([UNEXPLAINED]))
    return result


def _share(into: collections.Counter[str], tokens: int, causes: collections.Counter[str]) -> None:
    """Split `tokens` among `causes` by their counts (the remainder to the most common)."""
    if tokens <= 0:
        return
    count = sum(causes.values())
    given = 0
    for cause, n in causes.items():
        part = tokens * n // count
        into[cause] += part
        given += part
    into[causes.most_common(1)[0][0]] += tokens - given
