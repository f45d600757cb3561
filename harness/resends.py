"""What each fault of a soak cost in prompts sent to an engine again, charged to its cause.

Every worker of the soak gives its emulator a request log of its own
(`requests-<worker>.jsonl`): one line per chat request the engine accepted, with the time
(`ts`, the machine's wall clock, the soak's too), and a `crash` line when a prompt killed it.
A prompt sent more than once was sent again because something between its two sends broke the
first: `attribute()` charges each send after a prompt's first to

- the first fault between the two sends that hit the worker of the earlier send (its SIGKILL,
  its engine's SIGKILL or SIGSTOP, a prompt that crashed its engine), else
- the first fault between them that hit the whole fleet (Redis, S3), else
- `unexplained`: nothing broke in between, two copies of a batch ran at once.

Charging resends to whatever fault was played last before they were counted (the soak's first
accounting) put a kill's resends on the fault after it, since a killed worker's batches are
reaped and run again seconds later, and everything resent after the last fault on that fault:
678 prompts on broker blips in a short soak whose last fault was a blip, while the blip test
resends none.
"""

from __future__ import annotations

import collections
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import orjson

from harness.chaos import Played

UNEXPLAINED = "unexplained"
POISON = "poison_prompt"
# Faults that break nothing a batch runs on: they do not explain a resend.
HARMLESS = frozenset({"kill_producer", "stage_poison"})


def log_name(hostname: str) -> str:
    """The request log of worker `hostname`, named after it (`Sends.hostname` reads it back)."""
    return f"requests-{hostname.replace('@', '_at_')}.jsonl"


@dataclass(frozen=True)
class Send:
    at_s: float
    worker: str


@dataclass
class Sends:
    """Every chat request the fleet's engines accepted, read from their request logs as they
    grow: the sends of each prompt (by its text) and the engines' crashes on a prompt."""

    root: Path
    offsets: dict[Path, int] = field(default_factory=dict)
    by_prompt: dict[str, list[Send]] = field(default_factory=lambda: collections.defaultdict(list))
    crashes: list[Played] = field(default_factory=list)

    def read(self) -> None:
        for path in sorted(self.root.glob("requests-*.jsonl")):
            worker = path.name.removeprefix("requests-").removesuffix(".jsonl")
            worker = worker.replace("_at_", "@")
            with path.open("rb") as handle:
                handle.seek(self.offsets.get(path, 0))
                data = handle.read()
            complete = data[: data.rfind(b"\n") + 1]
            self.offsets[path] = self.offsets.get(path, 0) + len(complete)
            for line in complete.splitlines():
                entry = orjson.loads(line)
                if entry["outcome"] == "crash":
                    self.crashes.append(Played(float(entry["ts"]), POISON, worker))
                elif entry["outcome"] in {"ok", "abort"}:
                    text = entry["body"]["messages"][-1]["content"]
                    self.by_prompt[text].append(Send(float(entry["ts"]), worker))

    def resent(self, prefix: str = "") -> int:
        """Sends after each prompt's first so far, of the prompts whose text starts so."""
        self.read()
        return sum(len(s) - 1 for text, s in self.by_prompt.items() if text.startswith(prefix))


def attribute(
    sends: Iterable[Sequence[Send]], faults: Sequence[Played]
) -> collections.Counter[str]:
    """Each resend charged to its cause (see the module's docstring).

    >>> kill = Played(10.0, "kill_worker", "w1")
    >>> blip = Played(12.0, "broker_blip")
    >>> dict(attribute([[Send(5.0, "w1"), Send(20.0, "w2")]], [kill, blip]))
    {'kill_worker': 1}
    """
    causes = [f for f in sorted(faults, key=lambda f: f.at_s) if f.action not in HARMLESS]
    cost: collections.Counter[str] = collections.Counter()
    for prompt in sends:
        ordered = sorted(prompt, key=lambda s: s.at_s)
        for before, after in zip(ordered, ordered[1:], strict=False):
            between = [f for f in causes if before.at_s <= f.at_s <= after.at_s]
            hit = [f for f in between if f.target == before.worker]
            fleet = [f for f in between if f.target is None]
            cause = hit or fleet
            cost[cause[0].action if cause else UNEXPLAINED] += 1
    return cost
