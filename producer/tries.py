"""A record's tries: its original answer and those of the retry rounds, and which one stands.

`genfleet retry RUN --errors --stopped --cut` regenerates chosen records in a retry round:
a write-once round object in the run (`keys.retry_round_key`) and a run of its own that holds
the round's batches (`keys.retry_run`). Outputs stay write-once: an original answer is never
overwritten, a retry's answer is a new object. Export and report read the same merged view:

- the answer that stands for an (id, sample) is its newest **accepted** try: a retry's answer
  replaces an earlier one unless it is an error record (an error never replaces an answer;
  when every try is an error, the newest error stands);
- a try that stands and is not the original carries `try` (the round's number) and
  `tried_in` (`RETRY_RUN/batch-NNNNNN`); `run` and `batch` stay the original's, so a row is
  found where it always was. An original row has no `try` (it is try 0);
- only finished batches of a round count: a retry still running leaves the original
  standing;
- a round stages its records in the run's input order, so its answers are read in step
  with the run's own (one output object per round in memory).

What a retry takes (`retry_kind`): error records (`error`), answers the repetition guard
stopped (`stopped`, finish "repetition") and answers cut at max_tokens (`cut`, finish
"length"). Pure rules first; `Tries` reads the rounds (memory: the retried records, not the
run's).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

import orjson

from genfleet.common import keys
from genfleet.common.errors import GenfleetError
from genfleet.common.manifest import Manifest
from genfleet.common.store import Store
from genfleet.common.waste import is_stopped, waste_kind

RETRY_KINDS = ("errors", "stopped", "cut")


def retry_kind(record: Mapping[str, Any]) -> str | None:
    """Which retry flag takes `record`: "errors", "stopped", "cut", or None (an answer)."""
    if record.get("error"):
        return "errors"
    if is_stopped(record):
        return "stopped"
    if record.get("finish_reason") == "length":
        return "cut"
    return None


def replaces(new: Mapping[str, Any], old: Mapping[str, Any]) -> bool:
    """Whether a newer try `new` stands over `old`: yes unless it is an error record and
    `old` is not (an error never replaces an answer)."""
    return not new.get("error") or bool(old.get("error"))


def record_key(record: Mapping[str, Any]) -> tuple[str, int]:
    return (str(record.get("id")), int(record.get("sample") or 0))


class _Scan(Protocol):
    missing: list[str]

    def records(self) -> Iterator[dict[str, Any]]: ...


ScanStore = Callable[[Store, str], _Scan]


class RetryMismatch(GenfleetError):
    """A retry round or its answer does not belong to the run it is read with."""


@dataclass(frozen=True)
class RetryRound:
    """One round as its write-once object records it."""

    number: int
    run: str  # the run that holds its batches
    parent: str
    staging: str  # the parent's staging id when the round was made
    kinds: list[str]
    params: dict[str, Any]  # the parameters changed for it (max_tokens, repetition_guard)
    records: int
    at: float

    def to_json(self) -> dict[str, Any]:
        return dict(self.__dict__)


def read_rounds(store: Store, run: str) -> list[RetryRound]:
    """The run's retry rounds, oldest first (numbered from 1, read until one is missing: one
    GET for a run never retried)."""
    rounds: list[RetryRound] = []
    while (raw := store.get(keys.retry_round_key(run, len(rounds) + 1))) is not None:
        rounds.append(RetryRound(**orjson.loads(raw)))
    return rounds


def write_round(store: Store, round_: RetryRound) -> None:
    """Record a round, write-once; a concurrent round of the same number is refused."""
    key = keys.retry_round_key(round_.parent, round_.number)
    if not store.put_if_absent(key, orjson.dumps(round_.to_json())):
        raise RetryMismatch(
            f"run {round_.parent!r}: another retry of it began meanwhile ({key}); read "
            f"`genfleet status {round_.run}` and try again"
        )


@dataclass
class TryCounts:
    """What the merged view found, for export's and report's counts (the same for both)."""

    retried: int = 0  # records that have at least one finished retry
    replaced: int = 0  # ... whose standing answer is now a retry's
    kept: int = 0  # ... and that answer is a kept one (not error, stopped, cut or short)
    pending: int = 0  # batches of retry rounds without output yet


@dataclass
class _RoundStream:
    """One round's finished answers, read as they are needed: they come in the run's input
    order (a round stages its records in that order), so the next one is the next record of
    the run it answers."""

    round: RetryRound
    records: Iterator[dict[str, Any]]
    head: dict[str, Any] | None = None

    def advance(self) -> None:
        self.head = next(self.records, None)

    def take(self, key: tuple[str, int]) -> dict[str, Any] | None:
        """The round's answer to `key` when it is the next one, as a try; else None."""
        if self.head is None or record_key(self.head) != key:
            return None
        tried = {
            **self.head,
            "try": self.round.number,
            "tried_in": f"{self.round.run}/{self.head.get('batch')}",
        }
        self.advance()
        return tried


@dataclass
class Tries:
    """The finished retries of a run, each round read beside the run's own records.

    Rounds stage their records in the run's input order, so `merge` walks every round's
    outputs in step with the run's: memory is one output object per round, whatever the
    number of records retried."""

    run: str
    rounds: list[RetryRound] = field(default_factory=list)
    streams: list[_RoundStream] = field(default_factory=list)
    pending: int = 0  # batches of the rounds without output yet

    @classmethod
    def load(cls, store: Store, manifest: Manifest, scan_store: ScanStore) -> Tries:
        """`scan_store(store, run)`: export's, which reads a run's finished outputs.

        Raises RetryMismatch for a round made for another staging of the run (its answers
        are another run's) or whose run is gone (deleted on its own)."""
        tries = cls(manifest.run, read_rounds(store, manifest.run))
        for round_ in tries.rounds:
            if round_.staging != manifest.staging_id:
                raise RetryMismatch(
                    f"run {manifest.run!r}: retry round {round_.number} ({round_.run}) was made "
                    f"for staging {round_.staging[:12]}, the run is staging "
                    f"{manifest.staging_id[:12]}: its answers are not this run's; "
                    f"`genfleet delete {round_.run}` and remove "
                    f"{keys.retry_round_key(manifest.run, round_.number)}"
                )
            if Manifest.load(store, round_.run) is None:
                raise RetryMismatch(
                    f"run {manifest.run!r}: retry round {round_.number} has no run "
                    f"{round_.run!r} in {store.url} (deleted on its own?): remove "
                    f"{keys.retry_round_key(manifest.run, round_.number)} to export the run "
                    "without it"
                )
            scan = scan_store(store, round_.run)
            tries.pending += len(scan.missing)
            stream = _RoundStream(round_, scan.records())
            stream.advance()
            tries.streams.append(stream)
        return tries

    def merge(
        self, records: Iterator[dict[str, Any]], counts: TryCounts
    ) -> Iterator[dict[str, Any]]:
        """`records` (the originals, in input order) with each retried one replaced by its
        newest accepted try. Raises RetryMismatch for a try that answers another prompt than
        the run staged, or a record the run's finished batches do not hold."""
        counts.pending = self.pending
        for record in records:
            key = record_key(record)
            retry: dict[str, Any] | None = None
            for stream in self.streams:  # oldest round first: the newest accepted stands
                tried = stream.take(key)
                if tried is not None and (retry is None or replaces(tried, retry)):
                    retry = tried
            if retry is None:
                yield record
                continue
            counts.retried += 1
            if retry.get("prompt_sha256") != record.get("prompt_sha256"):
                raise RetryMismatch(
                    f"run {self.run!r}: {retry['tried_in']} answers {record.get('id')!r} "
                    f"(sample {record.get('sample') or 0}) for another prompt than "
                    f"{record.get('batch')} staged: nothing exported"
                )
            if not replaces(retry, record):
                yield record
                continue
            counts.replaced += 1
            counts.kept += waste_kind(retry) == "kept"
            yield {**retry, "run": record.get("run"), "batch": record.get("batch")}
        for stream in self.streams:
            if stream.head is not None:
                raise RetryMismatch(
                    f"run {self.run!r}: retry round {stream.round.number} ({stream.round.run}) "
                    f"answers {stream.head.get('id')!r}, which the run's finished batches do "
                    "not hold in that order: nothing exported"
                )


def selected(record: Mapping[str, Any], kinds: set[str]) -> bool:
    """Whether a retry asked for `kinds` takes `record` (its standing answer)."""
    kind = retry_kind(record)
    return kind is not None and kind in kinds
