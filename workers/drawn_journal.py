"""What a running batch's answers in flight drew since its last checkpoint, kept in Redis: the
one writer and reader of `keys.drawn_journal_key` and `keys.drawn_journal_tries_key`.

A batch's checkpoint (workers/checkpoint.py) copies its answers in flight whole to the store
every `checkpoint_interval_s`; a worker lost between two copies cost each answer what it drew
since the last one (half an interval on average, for every answer in flight). Every
`inflight_journal_interval_s` the batch's thread appends here, in one line, what each answer
drew since the last line: its new ids, their text and the reasoning split's state after them
(`Drawn.since`). The next try of the batch goes on from the longest answer it can rebuild
(`resumed`): a copy alone, or a copy and one try's lines after it.

What keeps two draws from mixing. Each try writes under its own key (a random `attempt`), and
each answer's lines name their *base*: the part of the copy they go on from, or -1 for an
answer this try began from its first token. A copy is one draw of each answer it holds, and a
try's lines after it are that try's own draw: so a node cut off and healed, still drawing
into its key while another try goes on from the same copy, adds a second candidate, never
ids to the first. A line goes on from exactly as many ids as its answer has when it is read
(`Drawn.extend`), else it and the rest of that answer's lines are not used. An answer the
try rebuilt from lines, not from a copy alone, has no base in the store: it is written here
only once this try's own copy holds it (`Journal.copied`; the batch copies such answers at
its first look).

Redis holds at most about one checkpoint interval of each try's lines: a try deletes its own
at each copy of its answers in flight, and every try's go when the batch's output is written
(`clear`). Each line names the order's staging and its batch's input digest (`binding`): a
run staged anew under its name never takes them. A failing Redis costs only the tokens these lines
would have saved; the checkpoint's copies still stand.
"""

from __future__ import annotations

import logging
import secrets
from collections import defaultdict
from collections.abc import Collection, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import orjson
import redis

from genfleet.common import keys
from genfleet.common.records import WorkOrder
from genfleet.common.redis_conn import RedisCommands, text
from genfleet.workers.feeding import Drawn, Mark

log = logging.getLogger("genfleet.drawn_journal")

Name = tuple[str, int]  # a prompt's (id, sample)
FROM_START = -1  # an answer's base: none, it was begun from its first token by this try
START = Mark(0, 0, 0, 0)


@dataclass(slots=True)
class Chain:
    """An answer of this try as the journal holds it: the object it follows, the copy it goes
    on from (`base`: a part number, FROM_START) and how much of it was written so far."""

    drawn: Drawn
    base: int
    mark: Mark


@dataclass(slots=True)
class Resumed:
    """An answer the next try goes on from; `base`: the part holding it whole, with its mark,
    or None when lines added to it (no copy holds all of it yet)."""

    drawn: Drawn
    base: tuple[int, Mark] | None


def binding(order: WorkOrder) -> str:
    """What a line is for: the order's staging and its batch's staged input (one per line,
    not per answer: within them, an (id, sample) is one prompt)."""
    return f"{order.staging}:{order.input_sha256}"


class Journal:
    """One try's lines (`flush`), and what the batch starts from (`resumed`)."""

    def __init__(
        self,
        client: RedisCommands,
        run: str,
        batch: str,
        bound: str,
        names: Collection[Name],
        carried: Mapping[Name, Resumed] | None = None,
    ) -> None:
        """`bound`: the order's `binding`; `names`: the batch's prompts; `carried`: the
        answers it goes on from (`resumed`)."""
        self.client, self.run, self.batch, self.bound = client, run, batch, bound
        self.names = names
        self.attempt = secrets.token_hex(8)
        self.key = keys.drawn_journal_key(run, batch, self.attempt)
        self.chains: dict[Name, Chain] = {}
        self.carried: set[Name] = set()  # answers an earlier try began: journaled from a copy
        for name, answer in (carried or {}).items():
            self.carried.add(name)
            if answer.base is not None:
                part, mark = answer.base
                self.chains[name] = Chain(answer.drawn, part, mark)

    @property
    def unbased(self) -> bool:
        """Some answer came back from lines: a copy should hold it soon (`copied`)."""
        return any(name not in self.chains for name in self.carried)

    def lines_since(
        self, live: Mapping[Name, Drawn]
    ) -> tuple[list[dict[str, Any]], dict[Name, Chain]]:
        """What each answer in flight drew since it was last written, and the chains as they
        will be once it is. Run on the feeder's loop (where `live` is written): it only reads."""
        answers: list[dict[str, Any]] = []
        after: dict[Name, Chain] = {}
        for name, drawn in live.items():
            chain = self.chains.get(name)
            if chain is None:
                if name in self.carried or name not in self.names:
                    continue  # its base is no copy yet, or it is no prompt of this batch
                chain = Chain(drawn, FROM_START, START)
            if chain.drawn is not drawn:
                continue  # the answer was begun again here: never mixed with the one before
            delta = drawn.since(chain.mark)
            if delta is None:
                continue
            answers.append(
                {
                    "id": name[0],
                    "sample": name[1],
                    "base": chain.base,
                    **delta,
                }
            )
            after[name] = Chain(drawn, chain.base, drawn.mark())
        return answers, after

    def flush(self, answers: list[dict[str, Any]], after: dict[Name, Chain]) -> bool:
        """Append one line; the chains move on only once Redis has it (else the next line
        carries the same ids again). False when Redis failed."""
        if not answers:
            return True
        line = orjson.dumps({"for": self.bound, "answers": answers}) + b"\n"
        tries = keys.drawn_journal_tries_key(self.run, self.batch)
        ttl_ms = keys.DRAWN_JOURNAL_TTL_S * 1000
        try:
            pipe = self.client.pipeline()
            pipe.append(self.key, line)
            pipe.pexpire(self.key, ttl_ms)
            pipe.hset(tries, self.attempt, self.bound)
            pipe.pexpire(tries, ttl_ms)
            pipe.execute()
        except redis.RedisError as exc:
            log.warning("%s/%s: answers in flight not journaled: %s", self.run, self.batch, exc)
            return False
        self.chains.update(after)
        return True

    def copied(self, part: int, copy: Iterable[tuple[Name, Drawn, Mark]], drop: bool) -> None:
        """A copy of answers in flight is in the store as `part` (each with the mark it was
        copied at): their lines go on from it. With `drop` (the copy holds every answer in
        flight of this try, and what finished is in the store) this try's lines are deleted."""
        for name, drawn, mark in copy:
            self.chains[name] = Chain(drawn, part, mark)
        if not drop:
            return
        try:
            self.client.delete(self.key)
        except redis.RedisError as exc:
            log.warning("%s/%s: journal of a copied try stays: %s", self.run, self.batch, exc)


def load(client: RedisCommands, run: str, batch: str) -> dict[str, list[dict[str, Any]]]:
    """Every try's lines, by attempt, in the order written ({} when Redis failed: the batch
    then goes on from its copies alone)."""
    try:
        tries = [text(t) for t in client.hkeys(keys.drawn_journal_tries_key(run, batch))]
        found: dict[str, list[dict[str, Any]]] = {}
        for attempt in tries:
            data = client.get(keys.drawn_journal_key(run, batch, attempt))
            if data:
                found[attempt] = [orjson.loads(line) for line in bytes(data).splitlines() if line]
        return found
    except (redis.RedisError, orjson.JSONDecodeError) as exc:
        log.warning("%s/%s: journal of answers in flight not read: %s", run, batch, exc)
        return {}


def clear(client: RedisCommands, run: str, batch: str) -> None:
    """The batch's output is written: every try's lines serve nobody any more."""
    tries_key = keys.drawn_journal_tries_key(run, batch)
    try:
        tries = [text(t) for t in client.hkeys(tries_key)]
        client.delete(tries_key, *(keys.drawn_journal_key(run, batch, t) for t in tries))
    except redis.RedisError as exc:
        log.warning("%s/%s: journal of answers in flight not cleared: %s", run, batch, exc)


def resumed(
    copies: Mapping[Name, Mapping[int, dict[str, Any]]],
    lines: Mapping[str, list[dict[str, Any]]],
    bound: str,
    names: Collection[Name],
) -> dict[Name, Resumed]:
    """The longest answer of each prompt that can be rebuilt from one draw: a copy (`copies`:
    by prompt, by part, its `Drawn.to_json`, already of this staging's prompt), or a copy (or
    nothing, base FROM_START) and one try's lines after it, lines for `bound` (`binding`) and
    the batch's prompts (`names`) only. Pure: what a try starts from."""
    best: dict[Name, Resumed] = {}

    def offer(name: Name, answer: Resumed) -> None:
        kept = best.get(name)
        if kept is None or len(answer.drawn.ids) > len(kept.drawn.ids):
            best[name] = answer

    for name, by_part in copies.items():
        for part, data in by_part.items():
            drawn = Drawn.from_json(data)
            offer(name, Resumed(drawn, (part, drawn.mark())))
    for attempt_lines in lines.values():
        chains: dict[tuple[Name, int], list[dict[str, Any]]] = defaultdict(list)
        for line in attempt_lines:
            if line.get("for") != bound:
                continue
            for answer in line.get("answers", []):
                name = (str(answer["id"]), int(answer["sample"]))
                if name not in names:
                    continue
                chains[(name, int(answer["base"]))].append(answer)
        for (name, base), deltas in chains.items():
            rebuilt = _rebuilt(copies.get(name, {}), base, deltas)
            if rebuilt is not None:
                offer(name, Resumed(rebuilt, None))
    return best


def _rebuilt(
    by_part: Mapping[int, dict[str, Any]], base: int, deltas: list[dict[str, Any]]
) -> Drawn | None:
    """One try's draw of one answer: its base, then each line in turn while it goes on from
    exactly the ids so far; None when its base is gone or no line added to it."""
    if base == FROM_START:
        drawn = Drawn.begun(deltas[0])
    elif base in by_part:
        drawn = Drawn.from_json(by_part[base])
    else:
        return None  # its copy was deleted (a later one holds more)
    added = False
    for delta in deltas:
        if not drawn.extend(delta):
            break  # a line lost between two that arrived: what follows is not this answer's
        added = True
    return drawn if added else None
