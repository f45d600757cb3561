"""`genfleet retry RUN --errors --stopped --cut`: a second chance for chosen records.

A retry round takes the records whose standing answer (producer/tries.py) is of a chosen
kind, reads their prompts from the run's own staged inputs (each checked against the digest
its answer names), and stages them as a run of their own (`keys.retry_run`) through the same
staging, work orders and workers as any run: write-once outputs, leases, checkpoints,
exactly-once. The round object (`keys.retry_round_key`), written once the round is staged,
binds it to the run's staging and records the parameters changed for it; from then on
`export` and `report` take each record's newest accepted answer.

Nothing of the run is overwritten. A retry interrupted before its round object is written
is finished by the same command again (same records, same parameters: the claim of its run
matches); `genfleet retry RUN` (no flag) also sends what the rounds' runs still lack.
"""

from __future__ import annotations

import gzip
import hashlib
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import orjson

from genfleet.common import keys, model_identity
from genfleet.common.errors import GenfleetError, InputError, RunMismatch
from genfleet.common.ledger import Ledger
from genfleet.common.manifest import Manifest
from genfleet.common.records import PromptRecord
from genfleet.common.redis_conn import connect
from genfleet.common.settings import Settings
from genfleet.common.store import Store, store_of
from genfleet.producer.enqueue import (
    EnqueueResult,
    Prepared,
    enqueue_run,
    generation_params,
    reader_options,
)
from genfleet.producer.export import answers, scan_store
from genfleet.producer.runs.identity import check_resumed, run_model
from genfleet.producer.tries import (
    RETRY_KINDS,
    RetryRound,
    TryCounts,
    read_rounds,
    record_key,
    retry_kind,
    selected,
    write_round,
)


@dataclass
class RetryResult:
    run: str
    round: int = 0  # 0: nothing to retry, no round made
    retry_run: str = ""
    kinds: list[str] = field(default_factory=list)
    params: dict[str, Any] = field(default_factory=dict)
    records: int = 0
    by_kind: dict[str, int] = field(default_factory=dict)
    batches_enqueued: int = 0

    def to_json(self) -> dict[str, Any]:
        return dict(self.__dict__)


def round_params(max_tokens: int | None, repetition_guard: bool) -> dict[str, Any]:
    """The parameters a round changes from the run's: only those asked for."""
    changes: dict[str, Any] = {}
    if max_tokens is not None:
        if max_tokens < 1:
            raise InputError(f"--max-tokens must be at least 1, got {max_tokens}")
        changes["max_tokens"] = max_tokens
    if not repetition_guard:
        changes["repetition_guard"] = False
    return changes


def round_parent(store: Store, run: str) -> str | None:
    """The run `run` is a retry round of (`PARENT.retry-NNNNNN`, recorded in the parent, or
    staged and not recorded yet), or None."""
    parent, dot, number = run.rpartition(".retry-")
    if not dot or not number.isdigit() or len(number) != 6 or not parent:
        return None
    try:
        keys.validate_run(parent)
    except ValueError:
        return None
    recorded = store.exists(keys.retry_round_key(parent, int(number)))
    return parent if recorded or Manifest.load(store, parent) is not None else None


def unfinished_rounds(store: Store, run: str) -> list[str]:
    """`round N (RUN.retry-N): K batches without output` for each round not finished."""
    found: list[str] = []
    for round_ in read_rounds(store, run):
        scan = scan_store(store, round_.run)
        if scan.missing:
            found.append(
                f"round {round_.number} ({round_.run}): {len(scan.missing)} of "
                f"{scan.manifest.batches_total} batches without output"
            )
    return found


def retry_records(
    settings: Settings,
    run: str,
    kinds: set[str],
    max_tokens: int | None = None,
    repetition_guard: bool = True,
) -> RetryResult:
    """Stage and send a retry round of `run`'s records whose standing answer is of `kinds`
    ("errors", "stopped", "cut"); RetryResult.round 0 when none is.

    Refused (nothing written) for a run whose settings ask for another model or parameters
    than it recorded (`check_resumed`: the run's own data only), and while an earlier round
    has batches without output (its answers are not in yet: retrying them again would
    generate them twice)."""
    unknown = kinds - set(RETRY_KINDS)
    if not kinds or unknown:
        raise InputError(f"retry kinds {sorted(kinds)}: choose from {', '.join(RETRY_KINDS)}")
    keys.validate_run(run)
    store = store_of(settings)
    parent = round_parent(store, run)
    if parent is not None:
        raise InputError(
            f"run {run!r} is a retry round of {parent!r}: its answers count only through "
            f"{parent!r}; retry that run (`genfleet retry {parent} --errors …`)"
        )
    manifest = Manifest.load(store, run)
    if manifest is None:
        raise InputError(f"run {run!r} has no manifest in {store.url}: was it enqueued?")
    check_resumed(manifest, settings, generation_params(settings))
    changes = round_params(max_tokens, repetition_guard)
    waiting = unfinished_rounds(store, run)
    if waiting:
        raise RunMismatch(
            f"run {run!r}: an earlier retry is not finished ({'; '.join(waiting)}): wait for "
            f"it (`genfleet status {keys.retry_run(run, len(read_rounds(store, run)))}`) or "
            f"send what it lacks (`genfleet retry {run}`), then retry again"
        )
    number = len(read_rounds(store, run)) + 1
    child = keys.retry_run(run, number)
    result = RetryResult(run, retry_run=child, kinds=sorted(kinds), params=changes)
    params = manifest.params.model_copy(update=changes)
    with tempfile.TemporaryDirectory(prefix="genfleet-retry-") as folder:
        path = Path(folder) / "records.jsonl"
        fingerprint = _write_selected(store, manifest, kinds, path, result)
        if not result.records:
            return result
        prepared = Prepared(
            path=path,
            fingerprint=fingerprint,
            params=params,
            ref=run_model(manifest),
            label=f"retry {number} of {run}: {', '.join(result.kinds)}",
            model=model_identity.read(store, run),  # the run's model: a worker serving another
        )
        enqueued: EnqueueResult = enqueue_run(
            settings, child, None, reader_options(settings), prepared=prepared
        )
    result.batches_enqueued = enqueued.batches_enqueued
    write_round(
        store,
        RetryRound(
            number=number,
            run=child,
            parent=run,
            staging=manifest.staging_id,
            kinds=result.kinds,
            params=changes,
            records=result.records,
            at=time.time(),
        ),
    )
    result.round = number
    return result


def _write_selected(
    store: Store, manifest: Manifest, kinds: set[str], path: Path, result: RetryResult
) -> str:
    """Write the staged lines of the records to retry to `path`, in input order; their
    sha256 (what staging them hashes). One batch's selection is held at a time."""
    digest = hashlib.sha256()
    scan = scan_store(store, manifest.run)
    batch: str | None = None
    chosen: dict[tuple[str, int], str | None] = {}
    with path.open("wb") as handle:

        def flush() -> None:
            if batch is not None and chosen:
                for line in _staged_lines(store, manifest.run, batch, chosen):
                    handle.write(line)
                    digest.update(line)

        for record in answers(scan, TryCounts()):
            if record.get("batch") != batch:
                flush()
                batch, chosen = str(record.get("batch")), {}
            if selected(record, kinds):
                chosen[record_key(record)] = record.get("prompt_sha256")
                kind = str(retry_kind(record))
                result.by_kind[kind] = result.by_kind.get(kind, 0) + 1
                result.records += 1
        flush()
    return digest.hexdigest()


def _staged_lines(
    store: Store, run: str, batch: str, chosen: dict[tuple[str, int], str | None]
) -> list[bytes]:
    """The staged lines of `chosen` in `batch`'s input, each checked against the digest its
    answer names: a retry never generates a prompt its run did not stage."""
    key = keys.input_key(run, batch)
    data = store.get(key)
    if data is None:
        raise GenfleetError(f"run {run!r}: {key} is missing: its records cannot be retried")
    lines: list[bytes] = []
    for line in gzip.decompress(data).splitlines():
        if not line.strip():
            continue
        record = PromptRecord.from_json(orjson.loads(line))
        if record.key not in chosen:
            continue
        want = chosen.pop(record.key)
        found = hashlib.sha256(line).hexdigest()
        if want is not None and found != want:
            raise RunMismatch(
                f"run {run!r}: {key} holds {record.id!r} (sample {record.sample}) with digest "
                f"{found[:12]}, its answer names {want[:12]}: not retried"
            )
        if orjson.dumps(record.to_json()) != line:  # staging writes the same bytes again
            raise RunMismatch(f"run {run!r}: {key}: {record.id!r} would be staged otherwise")
        lines.append(line + b"\n")
    if chosen:
        missing = ", ".join(repr(k[0]) for k in list(chosen)[:5])
        raise RunMismatch(f"run {run!r}: {key} does not hold {missing}: not retried")
    return lines


def resend_rounds(settings: Settings, run: str) -> list[EnqueueResult]:
    """`genfleet retry RUN`: what each retry round's run still lacks is sent again too."""
    store = store_of(settings)
    results: list[EnqueueResult] = []
    for round_ in read_rounds(store, run):
        Ledger(connect(settings)).clear_failed(round_.run)
        results.append(
            enqueue_run(settings, round_.run, None, reader_options(settings), verify=True)
        )
    return results
