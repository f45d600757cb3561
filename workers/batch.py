"""Running one work order: staged input in, one write-once output object out.

The order of things is what makes "nothing lost, nothing doubled" hold:
0. the batch's lease is taken first, before any store read (a heartbeat thread keeps it,
   whatever this thread waits on): a slow store must not let the reaper take a live batch;
1. the output exists → the batch is done (a duplicate delivery); skip;
2. read the staged input and any checkpoint parts; only prompts without a result are sent;
3. while prompts run, finished completions are flushed as a part every checkpoint_interval_s,
   so a crash loses at most that much work; a failed flush or progress report is tried again;
4. merge parts and new results in input order, `put_if_absent` the output — only then does
   the batch count as done (Redis counters follow the store, never lead it);
5. delete the parts, best effort: once the output exists they are garbage.
"""

from __future__ import annotations

import hashlib
import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import CancelledError, Future
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass, field
from typing import Any

import orjson
import redis

from genfleet.common import counters, keys, quality_gate
from genfleet.common import previous as old_answers
from genfleet.common.backoff import BOOKKEEPING, OUTPUT_WRITE
from genfleet.common.errors import (
    BatchCancelled,
    BatchHandedBack,
    BatchInputMissing,
    BatchInterrupted,
    BatchSuperseded,
    BatchTerminated,
    StoreError,
    StoreUnavailable,
)
from genfleet.common.ledger import Ledger, Tally
from genfleet.common.quality import GateSettings, QualityTally, judge
from genfleet.common.records import (
    CompletionRecord,
    GenerationParams,
    WorkOrder,
    encode_jsonl_gz,
)
from genfleet.common.redis_conn import RedisCommands, server_time
from genfleet.common.store import Store
from genfleet.common.waste import WasteTally
from genfleet.workers import checkpoint, drawn_journal
from genfleet.workers.crash_evidence import CrashEvidence
from genfleet.workers.feeding import Feeder, copy_of
from genfleet.workers.lease import Lease
from genfleet.workers.observe.live_progress import ProgressTally
from genfleet.workers.provenance import ensure_current, read_staged

log = logging.getLogger("genfleet.batch")


@dataclass
class BatchSummary:
    """What a finished batch reports (the task result Flower shows). No secrets, no text."""

    run: str
    batch: str
    worker: str
    prompts: int = 0
    completions: int = 0
    errors: int = 0
    resumed: int = 0  # prompts taken from checkpoint parts
    completion_tokens: int = 0
    reasoning_tokens: int = 0
    duration_s: float = 0.0
    tokens_per_s: float = 0.0
    skipped: bool = False  # the output already existed
    duplicate: bool = False  # another copy wrote the output first
    gpus: str | None = None
    accept_length: float | None = None
    generated_tokens: int = 0  # completion tokens generated in this try (not from parts)
    energy_j: float | None = None  # the batch's share of its GPUs' energy (None: no counter)
    gpu_s: float = 0.0  # the batch's share of its GPUs' time
    finish_reasons: dict[str, int] = field(default_factory=dict)
    # Where the batch's tokens went (common/waste.py): the run's counters' increments.
    waste: dict[str, int] = field(default_factory=dict)
    # What its answers are worth (common/quality.py): the run's counters' increments.
    quality: dict[str, int] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        """The task's result (what Flower shows, its repr cut at about 1 KB): the quality
        counts without their length histograms, which only the run's counters need."""
        figures = dict(self.__dict__)
        figures["quality"] = {
            k: v for k, v in self.quality.items() if not k.startswith(_HISTOGRAM_PREFIXES)
        }
        return figures


_HISTOGRAM_PREFIXES = ("quality_finished_le_", "quality_previous_le_")


class _Collector:
    """Results arriving from the loop thread, the part of them not yet checkpointed, and the
    prompts and tokens not yet added to the worker's progress tally."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.results: dict[int, CompletionRecord] = {}
        self.unflushed: list[CompletionRecord] = []
        self.unreported = [0, 0]  # prompts, completion tokens

    def add(self, index: int, record: CompletionRecord) -> None:
        with self.lock:
            self.results[index] = record
            self.unflushed.append(record)
            self.unreported[0] += 1
            self.unreported[1] += record.usage.completion_tokens

    def take_progress(self) -> tuple[int, int]:
        with self.lock:
            prompts, tokens = self.unreported
            self.unreported = [0, 0]
        return prompts, tokens

    def take_unflushed(self) -> list[CompletionRecord]:
        with self.lock:
            rows, self.unflushed = self.unflushed, []
        return rows

    def give_back_rows(self, rows: list[CompletionRecord]) -> None:
        with self.lock:
            self.unflushed = rows + self.unflushed


def order_params(store: Store, order: WorkOrder) -> GenerationParams:
    """The order's parameters with the run's response format read back from the store when
    the order names it (and checked against its sha256: another schema is never sent)."""
    if order.response_format_key is None:
        return order.params
    data = store.get(order.response_format_key)
    if data is None:
        raise BatchInputMissing(
            f"the run's response format {order.response_format_key} is missing from {store.url}"
        )
    if hashlib.sha256(data).hexdigest() != order.response_format_sha256:
        raise BatchInputMissing(
            f"the run's response format {order.response_format_key} in {store.url} is not the "
            f"one its work orders name (sha256 {order.response_format_sha256}): not sent"
        )
    return order.params.model_copy(update={"response_format": orjson.loads(data)})


def first_error(group: BaseExceptionGroup[BaseException]) -> BaseException:
    """The first leaf of an exception group: the failure that stopped the batch."""
    error: BaseException = group
    while isinstance(error, BaseExceptionGroup) and error.exceptions:
        error = error.exceptions[0]
    return error


def _why(exc: BaseException, order: WorkOrder, finished: int, todo: int) -> BaseException:
    """The error a failed try reports: what the task can map to requeue, retry or failure."""
    if isinstance(exc, BatchTerminated):
        return BatchTerminated(
            f"{order.run}/{order.batch} terminated by an operator (revoke) after {finished} of "
            f"{todo} prompts (checkpointed)"
        )
    if isinstance(exc, CancelledError):
        return BatchInterrupted(
            f"{order.run}/{order.batch} interrupted by shutdown after {finished} of {todo} "
            "prompts (checkpointed)"
        )
    if isinstance(exc, BaseExceptionGroup):
        # The feeder's TaskGroup wraps the first hard failure (EngineDown, ...) in an
        # ExceptionGroup; unwrapped, the task maps it to a retry or the failed set.
        return first_error(exc)
    return exc


def _check_cancelled(
    order: WorkOrder, cancelled: Callable[[], bool] | None, finished: int, todo: int
) -> None:
    if cancelled is None:
        return
    try:
        stop = cancelled()
    except redis.RedisError as exc:
        # A broker blip is no cancel: the batch goes on, and the next tick asks again.
        log.warning("%s/%s: cancel not checked (%s): going on", order.run, order.batch, exc)
        return
    if stop:
        raise BatchCancelled(
            f"{order.run}/{order.batch}: the run was cancelled; stopped after {finished} of "
            f"{todo} prompts (checkpointed)"
        )


def execute(
    order: WorkOrder,
    *,
    store: Store,
    client: RedisCommands,
    feeder: Feeder,
    worker: str,
    lease_ttl_s: float,
    checkpoint_interval_s: float,
    gpus: str | None = None,
    cancelled: Callable[[], bool] | None = None,
    lease_client: RedisCommands | None = None,
    output_tries: int = 5,
    progress: ProgressTally | None = None,
    gate: GateSettings | None = None,
    journal_interval_s: float = 0.0,
    handing_back: Callable[[], str | None] | None = None,
) -> BatchSummary:
    """Run one work order to its output object. `cancelled()` is polled while it runs and
    stops it; `lease_client` (default `client`) keeps the lease alive from a heartbeat thread,
    its calls should time out well inside the lease; `progress` is the worker's tally, shared
    by its batches (default: one of this batch's own); `gate`: the quality gate's settings
    for a run whose enqueue recorded none (the worker's; default: no gate);
    `journal_interval_s`: how often what the answers in flight drew is kept in Redis between
    two checkpoints (workers/drawn_journal.py; 0: never); `handing_back()`: asked at every
    tick, why the worker hands its running batches back to the queue now (None: it does
    not): the batch then stops as a shutdown stops it, its answers in flight kept first."""
    progress = ProgressTally() if progress is None else progress
    started = time.monotonic()
    summary = BatchSummary(run=order.run, batch=order.batch, worker=worker, gpus=gpus)
    output_key = keys.output_key(order.run, order.batch)
    lease_key = keys.lease_key(order.run, order.batch)
    # The lease from admission on, before the first store read: with a slow store the reads
    # alone can outlast a lease, and a batch without one is reaped and run a second time.
    with Lease(lease_client or client, lease_key, worker, lease_ttl_s):
        if store.exists(output_key):
            summary.skipped = True
            _mark_done(client, order)
            return summary
        data = store.get(order.key)
        if data is None:
            raise BatchInputMissing(f"staged input {order.key} is missing from {store.url}")
        # The run's staging was checked at admission (workers/admission.py); the writes below
        # check it again (a run can be deleted and staged anew while its batch runs).
        staged = read_staged(order, data)
        params = order_params(store, order)
        records = staged.records
        answers = old_answers.detach(records)  # --regenerate: never sent, copied to the output
        summary.prompts = len(records)
        checkpointed, next_part, in_flight = checkpoint.load_parts(store, order.run, order.batch)
        previous = checkpoint.kept_parts(staged, checkpointed)
        digests = staged.digest_of()
        lines = drawn_journal.load(client, order.run, order.batch) if journal_interval_s else {}
        bound = drawn_journal.binding(order)
        begun = drawn_journal.resumed(
            checkpoint.kept_drawn(staged, in_flight, previous), lines, bound, digests.keys()
        )
        begun = {key: answer for key, answer in begun.items() if key not in previous}
        drawn = {key: answer.drawn for key, answer in begun.items()}
        journal = (
            drawn_journal.Journal(client, order.run, order.batch, bound, digests.keys(), begun)
            if journal_interval_s
            else None
        )
        todo = [(i, r) for i, r in enumerate(records) if r.key not in previous]
        if answers:  # the longest-expected first: the batch does not end on a long straggler
            longest = old_answers.longest_first([i for i, _ in todo], answers)
            todo = [(i, records[i]) for i in longest]
        summary.resumed = len(records) - len(todo)

        _telemetry("the start time", _mark_started, client, order.run)
        collector = _Collector()
        future = feeder.run_batch(
            order.run,
            order.batch,
            [r for _, r in todo],
            params,
            lambda j, rec: collector.add(
                todo[j][0],
                _staged_as(
                    old_answers.attach(rec, answers.get(todo[j][0])), staged.digests[todo[j][0]]
                ),
            ),
            drawn=drawn,
        )
        inflight = _InFlight(feeder, order, digests, journal)
        try:
            next_part = _follow(
                future,
                order,
                store,
                _Reporter(client, worker, collector, progress),
                next_part,
                checkpoint_interval_s,
                cancelled,
                len(todo),
                inflight,
                journal_interval_s,
                handing_back,
            )
        except BaseException as exc:
            # Stop this try's requests: the retry sends the unfinished prompts again, and
            # requests left running would do that work twice and hold in-flight slots of other
            # batches. Only the engine failing or the worker stopping gets here. The answers
            # in flight are kept first: the retry goes on from their ids.
            next_part = inflight.save(store, next_part)
            future.cancel()
            checkpoint.save_finished(store, order, next_part, collector.take_unflushed())
            error = _why(exc, order, len(collector.results), len(todo))
            if error is exc:
                raise
            raise error from exc

        rows_out: list[dict[str, Any]] = []
        for index, record in enumerate(records):
            done = collector.results.get(index)
            rows_out.append(done.to_json() if done is not None else previous[record.key])
        summary.generated_tokens = sum(
            r.usage.completion_tokens for r in collector.results.values()
        )
        _still_current(store, order, output_tries)
        wrote = _put_output(store, output_key, encode_jsonl_gz(rows_out), output_tries)
        if wrote:
            _unless_superseded(store, order, output_key)
        summary.duplicate = not wrote
        gate = _run_gate(client, order.run, gate or GateSettings(on=False))
        quality = _summarise(summary, rows_out, started, gate.shorter_ratio)
        _Reporter(client, worker, collector, progress).report(order, ended=True)
        if wrote:
            _with_retries("the done counters", _count, client, order, summary)
            _telemetry("the quality gate", _judge, client, order, quality, gate, worker)
        else:
            _with_retries("the batch as done", _mark_done, client, order, summary.generated_tokens)
    # Last, and best effort: once the output exists the parts are garbage. Failing here used
    # to fail the try after the output was written, and the retry (which finds the output
    # and skips) never counted the batch's tokens and errors.
    try:
        store.delete_prefix(keys.parts_prefix(order.run, order.batch))
    except StoreError as exc:
        log.warning("could not delete the parts of %s/%s: %s", order.run, order.batch, exc)
    CrashEvidence(client).clear(order.run, order.batch)
    if journal_interval_s:
        drawn_journal.clear(client, order.run, order.batch)
    return summary


def _follow(
    future: Future[None],
    order: WorkOrder,
    store: Store,
    reporter: _Reporter,
    next_part: int,
    checkpoint_interval_s: float,
    cancelled: Callable[[], bool] | None = None,
    todo: int = 0,
    in_flight: _InFlight | None = None,
    journal_interval_s: float = 0.0,
    handing_back: Callable[[], str | None] | None = None,
) -> int:
    """Wait for the batch's prompts, reporting progress and checkpointing as they finish.

    Telemetry never costs work: a progress report or a checkpoint part that fails is logged
    and tried again at the next interval (its rows and counts kept); only the feeder's own
    failure (the engine, a shutdown) ends the wait early. Between two checkpoints what the
    answers in flight drew goes to the journal every `journal_interval_s`. Returns the next
    part number.
    """
    collector = reporter.collector
    look_s = max(min(reporter.progress.interval_s, checkpoint_interval_s), 0.1)
    journaling = bool(journal_interval_s) and in_flight is not None
    tick_s = max(min(look_s, journal_interval_s), 0.1) if journaling else look_s
    last_flush = last_look = time.monotonic()
    if in_flight is not None and in_flight.unbased:
        # Answers rebuilt from an earlier try's journal: a copy of them first, so that this
        # try's journal has a base in the store to go on from.
        next_part = in_flight.save(store, next_part)
    while True:
        try:
            future.result(timeout=tick_s)
            return next_part
        except FutureTimeout:
            pass
        why = handing_back() if handing_back is not None else None
        if why is not None:
            raise BatchHandedBack(
                f"{order.run}/{order.batch} handed back after {len(collector.results)} of "
                f"{todo} prompts (checkpointed): {why}"
            )
        if in_flight is not None and journaling:
            in_flight.journal_due(journal_interval_s)
        if time.monotonic() - last_look < look_s - tick_s / 2:
            continue  # a journal tick: the cancel flag and progress at their own pace
        last_look = time.monotonic()
        _check_cancelled(order, cancelled, len(collector.results), todo)
        reporter.report(order)
        if time.monotonic() - last_flush >= checkpoint_interval_s:
            flushed = True
            rows = collector.take_unflushed()
            if rows:
                try:
                    next_part = checkpoint.save(store, order, next_part, rows)
                except StoreError as exc:
                    flushed = False
                    collector.give_back_rows(rows)
                    log.warning(
                        "checkpoint of %s/%s failed (%s): kept for the next one",
                        order.run,
                        order.batch,
                        exc,
                    )
            if in_flight is not None:
                # The answers finished since the last copy are in the store now (else the
                # last copy stays: it is all that holds them)
                next_part = in_flight.save(store, next_part, drop_previous=flushed)
            last_flush = time.monotonic()


class _InFlight:
    """The batch's answers in flight drawn by ids, checkpointed beside its finished ones (and
    journaled in Redis between two copies) so that a worker lost mid-answer costs the next
    one only the tokens drawn since."""

    def __init__(
        self,
        feeder: Feeder,
        order: WorkOrder,
        digests: dict[tuple[str, int], str],
        journal: drawn_journal.Journal | None = None,
    ):
        self.feeder, self.order, self.digests, self.journal = feeder, order, digests, journal
        self.saved: dict[tuple[str, int], int] = {}  # ids kept last, by (id, sample)
        self.last_key: str | None = None  # the part holding this try's last copy
        self.journaled_at = time.monotonic()

    @property
    def unbased(self) -> bool:
        return self.journal is not None and self.journal.unbased

    def journal_due(self, interval_s: float) -> None:
        """Journal what the answers in flight drew since the last line, when `interval_s` has
        passed; best effort, like a copy."""
        journal = self.journal
        if journal is None or time.monotonic() - self.journaled_at < interval_s:
            return
        self.journaled_at = time.monotonic()
        order = self.order
        try:
            answers, after = self.feeder.read_live(order.run, order.batch, journal.lines_since)
        except (RuntimeError, FutureTimeout) as exc:  # the feeder's loop is gone or stuck
            log.warning("answers in flight of %s/%s not read: %s", order.run, order.batch, exc)
            return
        journal.flush(answers, after)

    def save(self, store: Store, next_part: int, drop_previous: bool = False) -> int:
        """Checkpoint every answer in flight once any drew since it was kept; best effort: a
        failure only means more tokens are drawn again should the worker be lost. Each copy
        is whole, so with `drop_previous` (the finished answers are in the store) the one
        before is deleted, and this try's journal with it: a batch keeps one copy of its
        answers in flight, not one for each interval it ran, and its next try reads only that."""
        order = self.order
        before = dict(self.saved)
        try:
            copy = self.feeder.read_live(
                order.run, order.batch, lambda live: copy_of(live, self.saved)
            )
        except (RuntimeError, FutureTimeout) as exc:  # the feeder's loop is gone or stuck
            log.warning("answers in flight of %s/%s not read: %s", order.run, order.batch, exc)
            return next_part
        copy = [entry for entry in copy if entry[0] in self.digests]
        rows = [checkpoint.drawn_row(name, self.digests[name], data) for name, _, data, _ in copy]
        if not rows:
            return next_part
        try:
            after = checkpoint.write_rows(store, order, next_part, rows)
        except (StoreError, BatchSuperseded) as exc:
            self.saved = before
            log.warning("answers in flight of %s/%s not kept: %s", order.run, order.batch, exc)
            return next_part
        if self.journal is not None:
            marks = [(name, drawn, mark) for name, drawn, _, mark in copy]
            self.journal.copied(after - 1, marks, drop=drop_previous)
        previous, self.last_key = self.last_key, keys.part_key(order.run, order.batch, after - 1)
        if previous is not None and drop_previous:
            try:
                # A part's key is the prefix of no other key: this deletes that part alone.
                store.delete_prefix(previous)
            except StoreError as exc:
                log.warning("an older copy of %s/%s stays: %s", order.run, order.batch, exc)
        return after


def _staged_as(record: CompletionRecord, digest: str) -> CompletionRecord:
    """The record names the staged prompt it answers (checked on resume and export)."""
    record.prompt_sha256 = digest
    return record


def _unless_superseded(store: Store, order: WorkOrder, output_key: str) -> None:
    """The output was written: if the run's staging changed while it was (a deletion and a
    new staging within that put), take it back, so the new run never holds this answer."""
    try:
        ensure_current(store, order)
    except BatchSuperseded:
        store.delete_prefix(output_key)
        raise


@dataclass
class _Reporter:
    """A batch's way to its worker's progress tally (workers/observe/live_progress.py)."""

    client: RedisCommands
    worker: str
    collector: _Collector
    progress: ProgressTally

    def report(self, order: WorkOrder, ended: bool = False) -> None:
        """Add what finished since the last call to the tally, which is written when its
        interval is due, or now when the batch `ended` (what it generated must not wait for
        another batch of the worker)."""
        self.progress.add(order.run, *self.collector.take_progress())
        self.progress.report(self.client, self.worker, now_due=ended)


def _telemetry(what: str, fn: Callable[..., Any], *args: Any) -> None:
    try:
        fn(*args)
    except redis.RedisError as exc:
        log.warning("could not record %s (%s)", what, exc)


def _with_retries(what: str, fn: Callable[..., Any], *args: Any, tries: int = 4) -> None:
    """Redis bookkeeping after the output exists: a blip must not fail a finished batch."""
    for attempt in range(1, tries + 1):
        try:
            fn(*args)
            return
        except redis.RedisError as exc:
            if attempt == tries:
                raise
            log.warning("could not record %s (%s): retry %d", what, exc, attempt)
            time.sleep(BOOKKEEPING.delay_s(attempt))


def _still_current(store: Store, order: WorkOrder, tries: int) -> None:
    """`ensure_current` before the output is written, tried again while the store is
    unreachable, as the output put is: the answers are in memory and the lease holds."""
    for attempt in range(1, tries + 1):
        try:
            ensure_current(store, order)
            return
        except StoreUnavailable as exc:
            if attempt == tries:
                raise
            log.warning("staging of %s not checked (%s): retry %d", order.run, exc, attempt)
            time.sleep(OUTPUT_WRITE.delay_s(attempt))


def _put_output(store: Store, key: str, data: bytes, tries: int) -> bool:
    """Write the output, trying again while the store is unreachable: every prompt of the
    batch is in memory and the lease holds, so waiting costs nothing; giving up redoes it."""
    for attempt in range(1, tries + 1):
        try:
            if store.put_if_absent(key, data):
                return True
            # A try that timed out may still have landed: the same bytes there are ours.
            return attempt > 1 and store.get(key) == data
        except StoreUnavailable as exc:
            if attempt == tries:
                raise
            log.warning("output %s not written (%s): retry %d", key, exc, attempt)
            time.sleep(OUTPUT_WRITE.delay_s(attempt))
    raise AssertionError("unreachable")


def _summarise(
    summary: BatchSummary, rows: list[dict[str, Any]], started: float, shorter_ratio: float
) -> QualityTally:
    tally = WasteTally()
    quality = QualityTally()
    for row in rows:
        tally.add(row)
        quality.add(row, shorter_ratio)
        if row.get("error"):
            summary.errors += 1
            continue
        summary.completions += 1
        usage = row.get("usage") or {}
        summary.completion_tokens += int(usage.get("completion_tokens") or 0)
        summary.reasoning_tokens += int(usage.get("reasoning_tokens") or 0)
        reason = str(row.get("finish_reason"))
        summary.finish_reasons[reason] = summary.finish_reasons.get(reason, 0) + 1
    summary.waste = tally.to_counters()
    summary.quality = quality.to_counters()
    summary.duration_s = round(time.monotonic() - started, 3)
    if summary.duration_s > 0:
        summary.tokens_per_s = round(summary.completion_tokens / summary.duration_s, 1)
    return quality


def _run_gate(client: RedisCommands, run: str, default: GateSettings) -> GateSettings:
    """The run's quality gate settings (its enqueue's); `default` when Redis does not say."""
    try:
        return quality_gate.settings_of(client, run, default)
    except redis.RedisError as exc:
        log.warning("could not read the quality gate of %s (%s): %s", run, exc, default)
        return default


def _judge(
    client: RedisCommands,
    order: WorkOrder,
    quality: QualityTally,
    gate: GateSettings,
    worker: str,
) -> None:
    """After the batch's output and counters are written: its answers enter the run's
    window, and the gate judges the window (common/quality.py); a run that trips pauses
    (common/quality_gate.py). A few Redis commands, bounded by the window, whatever the run."""
    quality_gate.add_window(client, order.run, quality, gate.window_answers)
    if not gate.on:
        return
    window = quality_gate.read_window(client, order.run, gate.window_answers)
    verdict = judge(window, gate, order.params.max_tokens, order.params.thinking)
    if verdict.tripped and quality_gate.pause(client, order.run, verdict, worker, time.time()):
        log.error("%s paused by the quality gate: %s", order.run, verdict.message())


def _mark_done(
    client: RedisCommands, order: WorkOrder, late_copy_tokens: int | None = None
) -> None:
    """The batch's output exists: no work order outstanding, not failed, done (another copy
    wrote it and counted its prompts; the store's listing repairs a count that was lost).
    `late_copy_tokens`: this copy generated the batch all the same, and threw that away."""
    Ledger(client).done(
        order.run, order.batch, prompts=order.prompts, late_copy_tokens=late_copy_tokens
    )


def _mark_started(client: RedisCommands, run: str) -> None:
    """The run's start, by Redis's clock: `status` compares it with its own "now" and with the
    last batch's end, which other hosts stamp."""
    counters.mark_started(client, run, server_time(client))


def _count(client: RedisCommands, order: WorkOrder, summary: BatchSummary) -> None:
    """Live counters, after the output is in the store (the store is the truth); the end time
    by Redis's clock, as the start's."""
    tally = Tally(
        summary.errors,
        summary.completion_tokens,
        summary.reasoning_tokens,
        server_time(client),
        more=summary.waste | summary.quality,
    )
    Ledger(client).done(order.run, order.batch, tally, prompts=summary.prompts)
