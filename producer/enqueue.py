"""Staging a dataset into the store and enqueueing one work order per batch.

First enqueue of a run: read → batch → write each batch to `RUN/inputs/…` and send its work
order as soon as it is staged (workers start while staging goes on), write rejects, then write
`RUN/manifest.json` last: a manifest means staging finished. Any later enqueue of the run
(`--resume`, a re-run, `retry`) stages nothing: it sends orders for the batches that have no
output in the store and no order outstanding, so a finished run enqueues nothing new and a
Redis that lost everything is rebuilt from the store alone.
"""

from __future__ import annotations

import gzip
import hashlib
import heapq
import re
import time
from array import array
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple

import orjson

from genfleet.common import keys, model_identity, quality_gate, run_registry
from genfleet.common.errors import ConfigError, InputError, RunMismatch
from genfleet.common.manifest import BatchEntry, Manifest, ManifestWriter
from genfleet.common.quality import gate_settings
from genfleet.common.readers import ReadAs, ReaderOptions, Reject, read_source
from genfleet.common.readers.fields import REGENERATE_HINT
from genfleet.common.records import (
    GenerationParams,
    PromptRecord,
    WorkOrder,
    batch_digest,
    dumps_jsonl,
    line_digests,
    response_format_bytes,
)
from genfleet.common.routing import ModelRef, model_ref, work_queue
from genfleet.common.settings import Settings
from genfleet.common.store import Store, store_of
from genfleet.producer.batching import expected_tokens, hinted_tokens, make_batches
from genfleet.producer.runs.identity import (
    SourceTally,
    changed_params,
    check_identity,
    check_resumed,
    claim_run,
    fingerprint_source,
    first_difference,
    is_stream,
    no_old_answer,
    run_model,
    staging_params,
)

Sender = Callable[[list[WorkOrder]], int]

# With length hints, up to this many staged batches wait (half of those staged so far, so the
# first goes out at once), so that the shortest-expected go out last (longest first in
# between): the run ends on short batches, not on one worker's long one.
HELD_BATCHES = 64


@dataclass
class EnqueueResult:
    run: str
    prompts: int = 0
    batches_total: int = 0
    batches_enqueued: int = 0
    batches_done: int = 0
    rejects: int = 0
    reject_samples: list[str] = field(default_factory=list)
    staged: bool = False  # False: the run existed and only missing batches were enqueued
    model: str | None = None
    engine: str | None = None
    queue: str | None = None
    uncancelled: bool = False  # the run was cancelled; this enqueue resumed it
    unpaused: dict[str, Any] | None = None  # the quality gate's verdict this enqueue lifted
    params_changed: dict[str, Any] = field(default_factory=dict)  # --change-params, recorded
    sources_unread: list[str] = field(default_factory=list)  # files not read to their end
    rows_unread: int = 0  # rows of those files known to be lost
    # lines refused because they end with an assistant answer (see --regenerate)
    ends_with_answer: int = 0
    # --regenerate: prompts with no old answer (a plain prompt, a chat ending with the user's
    # turn), asked afresh and exported without `previous`
    without_previous: int = 0
    # how each file was read: its shape, and where its prompt, system prompt, old answer and
    # id came from (`shapes.read_as`)
    read_as: list[str] = field(default_factory=list)

    def to_json(self) -> dict[str, Any]:
        return {
            "run": self.run,
            "model": self.model,
            "engine": self.engine,
            "queue": self.queue,
            "prompts": self.prompts,
            "batches_total": self.batches_total,
            "batches_enqueued": self.batches_enqueued,
            "batches_done": self.batches_done,
            "rejects": self.rejects,
            "staged": self.staged,
            "uncancelled": self.uncancelled,
            "unpaused": self.unpaused,
            "params_changed": self.params_changed,
            "sources_unread": self.sources_unread,
            "rows_unread": self.rows_unread,
            "ends_with_answer": self.ends_with_answer,
            "without_previous": self.without_previous,
            "read_as": self.read_as,
        }


def reader_options(
    settings: Settings, fmt: str | None = None, first_turn: bool = False, **columns: str | None
) -> ReaderOptions:
    return ReaderOptions(
        first_turn=first_turn,
        format=fmt,
        system_prompt=settings.system_prompt,
        limit=settings.limit,
        samples=settings.samples,
        max_line_bytes=settings.max_line_bytes,
        messages_col=columns.get("messages_col"),
        prompt_col=columns.get("prompt_col"),
        id_col=columns.get("id_col"),
        system_col=columns.get("system_col"),
        answer_col=columns.get("answer_col"),
        regenerate=settings.regenerate,
        s3_endpoint_url=settings.s3_endpoint_url,
        s3_region=settings.s3_region,
    )


def generation_params(settings: Settings) -> GenerationParams:
    """The run's parameters, recorded in its manifest and sent with every work order.

    `--json-schema FILE` is read here, once: the schema itself is what the run records.
    Raises ConfigError for a schema file or `--chat-template-kwargs` that is not a JSON object.
    """
    return GenerationParams(
        max_tokens=settings.max_tokens,
        temperature=settings.temperature,
        top_p=settings.top_p,
        thinking=settings.thinking,
        top_k=settings.top_k,
        min_p=settings.min_p,
        repetition_penalty=settings.repetition_penalty,
        response_format=_json_schema_format(settings.json_schema),
        chat_template_kwargs=_json_object(settings.chat_template_kwargs, "--chat-template-kwargs"),
    )


def _json_object(text: str | None, what: str) -> dict[str, Any] | None:
    if text is None:
        return None
    try:
        value = orjson.loads(text)
    except orjson.JSONDecodeError as exc:
        raise ConfigError(f"{what}: not JSON: {exc}") from exc
    if not isinstance(value, dict):
        raise ConfigError(f"{what}: must be a JSON object, got {type(value).__name__}")
    return value


def _json_schema_format(path: str | None) -> dict[str, Any] | None:
    """`--json-schema FILE` → an OpenAI `response_format` of type json_schema."""
    if path is None:
        return None
    try:
        text = Path(path).expanduser().read_text(encoding="utf-8")
    except OSError as exc:
        raise ConfigError(f"--json-schema {path}: {exc.strerror or exc}") from exc
    schema = _json_object(text, f"--json-schema {path}")
    name = re.sub(r"[^A-Za-z0-9_-]", "_", Path(path).name.split(".")[0])[:64] or "schema"
    return {"type": "json_schema", "json_schema": {"name": name, "schema": schema}}


class _Split:
    """Splits the reader's stream into prompts (passed on) and rejects (kept aside)."""

    def __init__(self, items: Iterator[PromptRecord | Reject]) -> None:
        self.items = items
        self.rejects: list[Reject] = []

    def __iter__(self) -> Iterator[PromptRecord]:
        for item in self.items:
            if isinstance(item, Reject):
                self.rejects.append(item)
            else:
                yield item


@dataclass(frozen=True)
class Prepared:
    """Prompts already staged once, to stage as a run of their own (a retry round's: the
    selected records' staged lines, in input order, in a local file of JSON lines), with the
    parameters and model they are generated with in place of the settings'."""

    path: Path
    fingerprint: str  # sha256 of the file's bytes: what staging hashes
    params: GenerationParams
    ref: ModelRef
    label: str  # the manifest's `source`
    model: dict[str, Any] | None = None  # the run's recorded model (common/model_identity.py)

    def records(self) -> Iterator[PromptRecord]:
        with self.path.open("rb") as handle:
            for line in handle:
                if line.strip():
                    yield PromptRecord.from_json(orjson.loads(line))


def stage(
    settings: Settings,
    store: Store,
    run: str,
    source: str,
    options: ReaderOptions,
    send: Sender,
    outstanding: set[str],
    prepared: Prepared | None = None,
) -> tuple[Manifest, EnqueueResult]:
    """Read `source`, stage its batches, send their orders, write rejects and the manifest.

    The source is read twice: once for its fingerprint, which the claim records before any
    batch is staged (an interrupted staging is finished only with the same data), then to
    stage it; a source that changed between the two is refused before the manifest is
    written, so the run never says it holds prompts it does not. A stream (a named pipe,
    `/dev/stdin`) is read once, as it is staged: its fingerprint goes to the manifest, and an
    interrupted staging of it is never finished (`claim_run` refuses it).
    """
    result = EnqueueResult(run=run, staged=True)
    read_as: list[ReadAs] = []
    digest = hashlib.sha256()
    tally = SourceTally()
    if prepared is None:
        split = _Split(read_source(source, options, read_as))
        params = generation_params(settings)
        ref = model_ref(settings)
        fingerprint = None if is_stream(source) else fingerprint_source(source, options, tally)
        old_answers = _OldAnswers(settings.regenerate, str(source), tally, fingerprint is None)
    else:  # a retry round's prompts: their run's own, checked when it was staged
        split = _Split(iter(prepared.records()))
        params, ref, fingerprint = prepared.params, prepared.ref, prepared.fingerprint
        old_answers = _OldAnswers(False, prepared.label, tally, False)
    pending: list[WorkOrder] = []
    held = _Held()
    staging_id = claim_run(
        store,
        run,
        params,
        ref,
        staging_params(settings),
        fingerprint,
        str(source),
        None if prepared else lambda: first_difference(store, run, source, options, settings),
    )
    # The run's model is decided here, before its first order: no worker decides it by
    # taking one first. A retry round's is its run's own (none for a run staged before).
    model = model_identity.asked(settings) if prepared is None else prepared.model
    if model is not None:
        model_identity.record(store, run, model)
    stored = store_response_format(store, run, params)
    done = done_batches(store, run)  # a run staged before but never finished its manifest
    writer = ManifestWriter(store, run, staging_id)  # one shard's entries held at a time
    tail = settings.batch_tail
    batches = make_batches(
        split, settings.batch_size, settings.batch_max_tokens, params.max_tokens, tail
    )
    last_send = time.monotonic()
    for index, records in enumerate(batches):
        batch = keys.batch_id(index)
        key = keys.input_key(run, batch)
        raw = dumps_jsonl(record.to_json() for record in records)
        digest.update(raw)
        sha256 = batch_digest(line_digests(raw))
        data = gzip.compress(raw, compresslevel=6, mtime=0)
        if batch in done and store.get(key) != data:
            raise RunMismatch(_interrupted(run, batch, store.url))
        store.put(key, data)
        work = sum(expected_tokens(record, params.max_tokens) for record in records)
        hinted = longest_hint(records, params.max_tokens)
        writer.add(
            BatchEntry(
                batch=batch,
                key=key,
                prompts=len(records),
                expected_tokens=work,
                longest_hint_tokens=hinted,
                sha256=sha256,
            )
        )
        result.prompts += len(records)
        result.without_previous += old_answers.staged(records)
        if batch not in done:
            order = _order(
                run,
                batch,
                len(records),
                params,
                ref,
                sha256=sha256,
                staging=staging_id,
                stored=stored,
            )
            if hinted is None:
                pending.append(order)
            else:
                held.hold(order, hinted, pending)
        # Send in chunks that grow from one batch to 64 (the first batch goes out at once, so
        # GPUs start while staging goes on), and at least once a second: a slow source must
        # not hold back batches that are staged already while GPUs wait.
        chunk = min(64, max(1, result.batches_enqueued))
        due = len(pending) >= chunk or (bool(pending) and time.monotonic() - last_send >= 1.0)
        if due and not old_answers.holding:
            result.batches_enqueued += _send(send, pending, outstanding)
            last_send = time.monotonic()
    old_answers.finish(store, run, read_as)
    held.release(pending)
    result.batches_enqueued += _send(send, pending, outstanding)
    result.rejects = len(split.rejects)
    result.read_as = [str(reading) for reading in read_as]
    cut = [reject for reject in split.rejects if reject.truncated]
    result.sources_unread = sorted({reject.file for reject in cut})
    result.rows_unread = sum(reject.rows_unread or 0 for reject in cut)
    result.reject_samples = [str(reject) for reject in split.rejects[:20]]
    result.ends_with_answer = sum(1 for r in split.rejects if r.reason == REGENERATE_HINT)
    if split.rejects:
        store.put(
            keys.rejects_key(run),
            b"".join(orjson.dumps(reject.to_json()) + b"\n" for reject in split.rejects),
        )
    if not writer.batches:
        reason = f"{source}: no valid prompt"
        if split.rejects:
            reason += f" ({len(split.rejects)} rejected; first: {split.rejects[0]})"
        if result.ends_with_answer:
            reason += f"; {regenerate_advice(result.ends_with_answer)}"
        # Nothing was staged: the claim binds no batch, so the same run may be staged again
        # with other settings (typically --regenerate).
        store.delete_prefix(keys.claim_key(run))
        model_identity.withdraw(store, run)
        raise InputError(reason)
    if fingerprint is not None and digest.hexdigest() != fingerprint:
        raise InputError(
            f"{source} changed while it was staged (fingerprint {fingerprint[:12]} when the "
            f"run was claimed, {digest.hexdigest()[:12]} as staged): no manifest written; "
            f"`genfleet delete {run}` and stage it again once it no longer changes"
        )
    manifest = writer.finish(
        source=str(source),
        format=options.format or "auto",
        fingerprint=digest.hexdigest(),
        created_at=time.time(),
        params=params,
        model=ref.model,
        engine=ref.engine,
        staging=staging_params(settings),
        prompts_total=result.prompts,
        rejects=result.rejects,
        sources_unread=result.sources_unread,
        rows_unread=result.rows_unread,
    )
    result.batches_total = manifest.batches_total
    result.batches_done = len(done)
    return manifest, result


def longest_hint(records: list[PromptRecord], max_tokens: int) -> int | None:
    """The longest answer a batch's old answers hint at: how long the batch is expected to
    run, its prompts running side by side. None when none of its prompts has a hint."""
    hints = [hint for r in records if (hint := hinted_tokens(r, max_tokens)) is not None]
    return max(hints) if hints else None


class _OldAnswers:
    """`--regenerate`'s check that the source has old answers to replace.

    A file is judged on the fingerprint's first pass, before anything is written: none has
    one, it is refused. A stream has no first pass: no order goes out until a prompt with an
    old answer is staged, and a stream with none is refused at its end, its staging removed,
    nothing sent. Prompts without one beside others are counted (`without_previous`)."""

    def __init__(self, regenerate: bool, source: str, tally: SourceTally, stream: bool) -> None:
        if regenerate and tally.prompts and not tally.with_previous:
            raise InputError(no_old_answer(source, tally.read_as))
        self.regenerate = regenerate
        self.source = source
        self.holding = regenerate and stream
        self.any = False

    def staged(self, records: list[PromptRecord]) -> int:
        """Of a staged batch, the prompts without an old answer (0 without --regenerate)."""
        if not self.regenerate:
            return 0
        self.any = True
        without = sum(record.previous is None for record in records)
        self.holding = self.holding and without == len(records)
        return without

    def finish(self, store: Store, run: str, read_as: list[ReadAs]) -> None:
        """At the end of staging: a stream that never had an old answer is refused."""
        if self.holding and self.any:
            store.delete_prefix(f"{run}/")  # this staging's own: a stream's claim is not reused
            raise InputError(no_old_answer(self.source, read_as))


class _Held:
    """Hinted batches waiting to be sent: the longest-expected goes on as soon as more wait
    than half the batches staged so far (at most HELD_BATCHES); at the end of staging the rest
    go, longest first."""

    def __init__(self) -> None:
        self._heap: list[tuple[int, int, WorkOrder]] = []  # (-longest hint, index, order)
        self._staged = 0

    def hold(self, order: WorkOrder, hinted: int, pending: list[WorkOrder]) -> None:
        self._staged += 1
        heapq.heappush(self._heap, (-hinted, keys.batch_index(order.batch), order))
        while len(self._heap) > min(HELD_BATCHES, self._staged // 2):
            pending.append(heapq.heappop(self._heap)[2])

    def release(self, pending: list[WorkOrder]) -> None:
        while self._heap:
            pending.append(heapq.heappop(self._heap)[2])


def without_previous_text(prompts: int, of: int) -> str:
    """What a `--regenerate` staging says of its prompts that had no old answer to replace."""
    return (
        f"--regenerate: no old answer in {prompts:,} of {of:,} prompts (a plain prompt, or a "
        "conversation whose last turn is the user's): asked afresh, exported without `previous`"
    )


def regenerate_advice(lines: int) -> str:
    """What to do about lines refused for ending with an assistant answer."""
    what = "line ends" if lines == 1 else "lines end"
    return (
        f"{lines:,} {what} with an assistant answer: to replace those answers (kept in each "
        "record as `previous`), stage the data with --regenerate"
    )


def _interrupted(run: str, batch: str, url: str) -> str:
    return (
        f"run {run!r} in {url} has no manifest (an earlier staging was interrupted) but has "
        f"outputs of other prompts ({batch} differs): use --run NEW, or `genfleet delete {run}`"
    )


def _order(
    run: str,
    batch: str,
    prompts: int,
    params: GenerationParams,
    ref: ModelRef,
    *,
    sha256: str,
    staging: str,
    stored: tuple[str, str] | None = None,
) -> WorkOrder:
    """A batch's work order; with `stored` (the key and sha256 `store_response_format`
    returned) the order names the run's response format instead of carrying it."""
    if stored is not None:
        params = params.model_copy(update={"response_format": None})
    return WorkOrder(
        run=run,
        batch=batch,
        input_sha256=sha256,
        staging=staging,
        params=params,
        model=ref.model,
        engine=ref.engine,
        prompts=prompts,
        enqueued_at=time.time(),
        response_format_key=stored[0] if stored else None,
        response_format_sha256=stored[1] if stored else None,
    )


def store_response_format(
    store: Store, run: str, params: GenerationParams
) -> tuple[str, str] | None:
    """Store the run's response format once (by its content hash); its key and sha256, or
    None when the run has none. Idempotent: a resume writes the same object again."""
    if params.response_format is None:
        return None
    data = response_format_bytes(params.response_format)
    sha256 = hashlib.sha256(data).hexdigest()
    key = keys.response_format_key(run, sha256)
    store.put(key, data)
    return key, sha256


def _send(send: Sender, pending: list[WorkOrder], outstanding: set[str]) -> int:
    orders = [order for order in pending if order.batch not in outstanding]
    pending.clear()
    if not orders:
        return 0
    sent = send(orders)
    outstanding.update(order.batch for order in orders)
    return sent


def done_batches(store: Store, run: str) -> set[str]:
    """Batches whose output object exists: the store's word on what is finished."""
    return {keys.batch_from_output_key(k) for k in store.list(keys.outputs_prefix(run))}


def enqueue_missing(
    store: Store,
    manifest: Manifest,
    send: Sender,
    outstanding: set[str],
    only: set[str] | None = None,
    done: set[str] | None = None,
) -> EnqueueResult:
    """Send orders for the manifest's batches that have no output and no outstanding order
    (`done`: the store's listing, when the caller has it already), SEND_CHUNK at a time as
    the manifest's shards are read."""
    done = done_batches(store, manifest.run) if done is None else done
    result = EnqueueResult(
        run=manifest.run,
        prompts=manifest.prompts_total,
        batches_total=manifest.batches_total,
        batches_done=len(done),
        rejects=manifest.rejects,
        sources_unread=list(manifest.sources_unread),
        rows_unread=manifest.rows_unread,
    )
    ref = run_model(manifest)
    result.model, result.engine = ref.model, ref.engine
    stored = store_response_format(store, manifest.run, manifest.params)
    wanted = _wanted(manifest, store, done, only)
    dues = (Due(entry.batch, entry.prompts, entry.sha256) for entry in wanted)
    pending: list[WorkOrder] = []
    for due in longest_first(wanted) if manifest.hinted else dues:
        pending.append(
            _order(
                manifest.run,
                due.batch,
                due.prompts,
                manifest.params,
                ref,
                sha256=due.sha256,
                staging=manifest.staging_id,
                stored=stored,
            )
        )
        if len(pending) >= SEND_CHUNK:
            result.batches_enqueued += _send(send, pending, outstanding)
    result.batches_enqueued += _send(send, pending, outstanding)
    return result


# Orders a resume sends at a time: what it holds is this many orders, not the run's.
SEND_CHUNK = 1000
_MAX_HINT = 2**31 - 1


class Due(NamedTuple):
    """A batch whose order a resume sends: what the order takes from its manifest entry."""

    batch: str
    prompts: int
    sha256: str


def _wanted(
    manifest: Manifest, store: Store, done: set[str], only: set[str] | None
) -> Iterator[BatchEntry]:
    """The manifest's batches without output (and in `only`), read shard by shard."""
    for entry in manifest.entries(store):
        if entry.batch not in done and (only is None or entry.batch in only):
            yield entry


def longest_first(entries: Iterable[BatchEntry]) -> Iterator[Due]:
    """`entries` (in batch order) longest-hinted first and in batch order within a hint, as
    staging sent them. What waits meanwhile is under 100 bytes per batch (its place, prompts
    and digest in flat arrays, and the sort), not the entries (a few KB each as objects): a
    resume of a 390K-batch run with hints holds under 40 MB while it sorts them."""
    places = array("q")  # (_MAX_HINT - hint) << 32 | position: sorted, the send order
    indexes, prompts = array("q"), array("q")
    digests, hashed = bytearray(), bytearray()
    for entry in entries:
        hint = min(entry.longest_hint_tokens or 0, _MAX_HINT)
        places.append((_MAX_HINT - hint) << 32 | len(indexes))
        indexes.append(keys.batch_index(entry.batch))
        prompts.append(entry.prompts)
        digests += bytes.fromhex(entry.sha256) if entry.sha256 else bytes(32)
        hashed.append(bool(entry.sha256))
    for place in sorted(places):
        position = place & 0xFFFFFFFF
        digest = digests[position * 32 : position * 32 + 32].hex() if hashed[position] else ""
        yield Due(keys.batch_id(indexes[position]), prompts[position], digest)


def enqueue_run(
    settings: Settings,
    run: str,
    source: str | None,
    options: ReaderOptions,
    only: set[str] | None = None,
    verify: bool = False,
    prepared: Prepared | None = None,
) -> EnqueueResult:
    """Stage `source` as `run` (first time), or enqueue what the run still lacks (later).
    `prepared` stages prompts already read (a retry round's) in place of a source.

    With `verify` (`--resume`, `retry`), the orders believed outstanding are checked against
    what the broker really holds, so an order lost from Redis is sent again.
    """
    from genfleet.common.ledger import Ledger
    from genfleet.common.redis_conn import connect
    from genfleet.producer.broker import (
        make_client_app,
        orders_in_broker,
        purge_orders,
        send_orders,
    )

    keys.validate_run(run)
    store = store_of(settings)
    manifest = Manifest.load(store, run)
    if manifest is not None:  # before anything is touched
        params = generation_params(settings)
        if source is not None:
            check_identity(manifest, settings, params, source, options)
        else:
            check_resumed(manifest, settings, params)
        changes = changed_params(manifest, settings, params, resumed=source is None)
    else:
        changes = {}
    if manifest is not None:
        ref = run_model(manifest)
    else:
        ref = prepared.ref if prepared is not None else model_ref(settings)
    queue = work_queue(settings.queue, ref)
    client = connect(settings)
    app = make_client_app(settings)
    ledger = Ledger(client)
    if manifest is not None and changes:
        # The rest goes on with the new parameters: recorded in the run, and the orders
        # waiting with the old ones taken back, to be sent anew below.
        manifest.record_change(store, changes, time.time(), "--change-params")
        ledger.unqueue(run, purge_orders(client, queue, run))
    # Enqueueing a cancelled run resumes it, and so does a pause of the quality gate (with
    # its window: the rest is judged afresh, by the gate settings of this enqueue). The flag
    # goes before what is outstanding is read: a worker parks an order (it then has none)
    # only while the flag stands (`Ledger.park`), so an order parked before this is not in
    # the listing and is sent again, and none is parked after it.
    quality_gate.record_settings(client, run, gate_settings(settings))
    unpaused = quality_gate.resume(client, run)
    uncancelled = ledger.release_hold(run)
    if verify:
        outstanding = orders_in_broker(client, queue, run)
        ledger.set_queued(run, outstanding)
    else:
        outstanding = ledger.queued(run)

    staging_since = time.time()
    staging = keys.staging_key(run)
    staging_now: list[bool] = []  # non-empty while this call stages the run

    def send(orders: list[WorkOrder]) -> int:
        ledger.mark_queued(run, [order.batch for order in orders])
        client.sadd(keys.work_queues_key(), queue)
        if staging_now:
            client.set(staging, staging_since, ex=keys.STAGING_TTL_S)
        return send_orders(app, settings, orders)

    run_registry.register(client, run)
    if manifest is None:
        if source is None and prepared is None:
            raise InputError(f"run {run!r} has no manifest in {store.url}: give a SOURCE")
        source = prepared.label if prepared is not None else str(source)
        client.set(staging, staging_since, ex=keys.STAGING_TTL_S)
        staging_now.append(True)
        try:
            manifest, result = stage(
                settings, store, run, source, options, send, outstanding, prepared
            )
        finally:
            staging_now.clear()
            client.delete(staging)
    else:
        listed = done_batches(store, run)
        result = enqueue_missing(store, manifest, send, outstanding, only, listed)
        if verify:  # resume and retry list the store: the progress copy is repaired from it
            from genfleet.common import progress

            progress.reconcile(
                client,
                store,
                manifest,
                listed,
                still_absent=lambda batch: not store.exists(keys.output_key(run, batch)),
            )
    result.model, result.engine, result.queue = ref.model, ref.engine, queue
    result.uncancelled = uncancelled
    result.unpaused = unpaused
    result.params_changed = changes
    return result
