"""What each fault of a soak cost in prompts sent to an engine again, charged to its cause.

Every worker of the soak gives its emulator a request log of its own
(`requests-<worker>.jsonl`): one line per request the engine accepted (a chat request, or
each prompt of a /generate request: its prompt's ids hashed and the output tokens it carried
in), with the time (`ts`, the machine's wall clock, the soak's too) and the engine process
(`pid`), an `end` line with what each request generated, and a `crash` line when a prompt
killed it. A prompt sent more than once was sent again because something between its two
sends broke the first: `attribute()` charges each send after a prompt's first to

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
from typing import Any

import orjson

from harness.chaos import Played

UNEXPLAINED = "unexplained"
POISON = "poison_prompt"
# Faults that break nothing a batch runs on: they do not explain a resend.
HARMLESS = frozenset({"kill_producer", "stage_poison"})


def log_name(hostname: str) -> str:
    """The request log of worker `hostname`, named after it (`Sends.hostname` reads it back)."""
    return f"requests-{hostname.replace('@', '_at_')}.jsonl"


def worker_of(path: Path) -> str:
    """The worker whose request log (or a file named after it) `path` is."""
    name = path.name.removeprefix("requests-").split(".jsonl", 1)[0]
    return name.replace("_at_", "@")


def prompt_of(entry: dict[str, Any]) -> str | None:
    """The prompt a request-log line sent: a chat request's last message, a /generate
    prompt's hashed ids; None for a line that sent none (a refusal, an end, a crash)."""
    if entry["outcome"] not in {"ok", "abort"}:
        return None
    if entry.get("route") == "generate":
        return str(entry["prompt"])
    return str(entry["body"]["messages"][-1]["content"])


@dataclass(frozen=True)
class Send:
    """One request of a prompt to an engine: when, on which worker's engine (process `pid`),
    its id (`rid`, which its `end` line names) and the output tokens it carried in."""

    at_s: float
    worker: str
    pid: int = 0
    rid: str | None = None
    drawn: int = 0


@dataclass
class Sends:
    """Every request the fleet's engines accepted, read from their request logs as they grow:
    the sends of each prompt (by its text or hashed ids), what each ended request generated
    (by its id) and the engines' crashes on a prompt."""

    root: Path
    offsets: dict[Path, int] = field(default_factory=dict)
    by_prompt: dict[str, list[Send]] = field(default_factory=lambda: collections.defaultdict(list))
    ended: dict[str, int] = field(default_factory=dict)
    crashes: list[Played] = field(default_factory=list)

    def read(self) -> None:
        for path in sorted(self.root.glob("requests-*.jsonl")):
            worker = worker_of(path)
            with path.open("rb") as handle:
                handle.seek(self.offsets.get(path, 0))
                data = handle.read()
            complete = data[: data.rfind(b"\n") + 1]
            self.offsets[path] = self.offsets.get(path, 0) + len(complete)
            for line in complete.splitlines():
                self._take(orjson.loads(line), worker)

    def _take(self, entry: dict[str, Any], worker: str) -> None:
        if entry["outcome"] == "crash":
            self.crashes.append(Played(float(entry["ts"]), POISON, worker))
        elif entry["outcome"] == "end":
            self.ended[str(entry["id"])] = int(entry["generated"])
        elif (prompt := prompt_of(entry)) is not None:
            send = Send(
                float(entry["ts"]),
                worker,
                int(entry.get("pid") or 0),
                entry.get("id"),
                int(entry.get("drawn") or 0),
            )
            self.by_prompt[prompt].append(send)

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
    causes = breaking(faults)
    cost: collections.Counter[str] = collections.Counter()
    for prompt in sends:
        ordered = sorted(prompt, key=lambda s: s.at_s)
        for before, after in zip(ordered, ordered[1:], strict=False):
            cost[cause_of(before, after.at_s, causes)] += 1
    return cost


def breaking(faults: Iterable[Played]) -> list[Played]:
    """The faults that may explain a resend, in the order they were played."""
    return [f for f in sorted(faults, key=lambda f: f.at_s) if f.action not in HARMLESS]


def cause_of(send: Send, until_s: float, causes: Sequence[Played], last: bool = False) -> str:
    """What broke `send` before `until_s` (the prompt's next send): the first fault in between
    that hit its worker, else the first that hit the whole fleet, else `unexplained`. With
    `last`, the last of them instead: what the answer lost is what the last fault left of it
    (an engine frozen, then its worker killed: the kill took the ids the worker held)."""
    between = [f for f in causes if send.at_s <= f.at_s <= until_s]
    cause = [f for f in between if f.target == send.worker] or [
        f for f in between if f.target is None
    ]
    return cause[-1 if last else 0].action if cause else UNEXPLAINED


def sent_lines(path: Path) -> list[dict[str, Any]]:
    """An engine's request log without its `end` lines: one line per request it was sent
    (a chat request, or one /generate prompt), as the chat request each stands for."""
    if not path.exists():
        return []
    lines = [orjson.loads(line) for line in path.read_bytes().splitlines()]
    return [line for line in lines if line.get("outcome") != "end"]
