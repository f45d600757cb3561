"""Checking that an enqueue matches the run it names: same prompts, parameters, batching,
model and engine, or a refusal (RunMismatch, exit 2) that names each difference and touches
neither the store nor the queue.

The prompts' fingerprint is the sha256 of the staged records as JSON lines in input order:
`stage` hashes the bytes it writes, `fingerprint_source` the same bytes without writing.
"""

from __future__ import annotations

import dataclasses
import gzip
import hashlib
import os
import secrets
import stat
from collections.abc import Callable
from typing import Any

import orjson

from genfleet.common import keys
from genfleet.common.errors import RunMismatch
from genfleet.common.manifest import IDENTITY_VERSION, Manifest, RunIdentity
from genfleet.common.readers import ReadAs, ReaderOptions, Reject, read_source
from genfleet.common.records import GenerationParams
from genfleet.common.routing import ModelRef, model_ref
from genfleet.common.settings import Settings
from genfleet.common.store import Store, store_of


def staging_params(settings: Settings) -> dict[str, Any]:
    """How prompts are read and cut into batches: part of a run's identity. (The prompts'
    fingerprint covers what these do to the prompts; naming them makes a refusal say why.)"""
    staging: dict[str, Any] = {
        "batch_size": settings.batch_size,
        "batch_max_tokens": settings.batch_max_tokens,
        "samples": settings.samples,
        "limit": settings.limit,
        "system_prompt": settings.system_prompt,
    }
    if settings.batch_tail:  # named only when set: runs staged without it keep their identity
        staging["batch_tail"] = settings.batch_tail
    if settings.regenerate:  # the same: named only when set
        staging["regenerate"] = True
    return staging


# What a claim records for a source that can be read only once: its fingerprint is taken as it
# is staged (and written to the manifest), never before.
STREAM_FINGERPRINT = "(a stream, read once: its content is known only as it is staged)"


def is_stream(source: str) -> bool:
    """Whether `source` can be read only once: a named pipe, a character device
    (`/dev/stdin`) or a socket, rather than a file, a folder or an S3 object."""
    if source.startswith("s3://"):
        return False
    try:
        mode = os.stat(source).st_mode
    except OSError:
        return False
    return not (stat.S_ISREG(mode) or stat.S_ISDIR(mode))


@dataclasses.dataclass
class SourceTally:
    """What the fingerprint's pass over a source saw, for `stage` to judge before it writes
    anything: its prompts, those with an old answer (`--regenerate`), how each file was read."""

    prompts: int = 0
    with_previous: int = 0
    read_as: list[ReadAs] = dataclasses.field(default_factory=list)


def fingerprint_source(
    source: str, options: ReaderOptions, tally: SourceTally | None = None
) -> str:
    """The fingerprint `stage` would record for `source`, with nothing written anywhere."""
    digest = hashlib.sha256()
    tally = tally if tally is not None else SourceTally()
    for item in read_source(source, options, tally.read_as):
        if not isinstance(item, Reject):
            digest.update(orjson.dumps(item.to_json()) + b"\n")
            tally.prompts += 1
            tally.with_previous += item.previous is not None
    return digest.hexdigest()


def no_old_answer(source: str, readings: list[ReadAs]) -> str:
    """Why a `--regenerate` staging of `source` is refused when none of its prompts has an
    old answer to replace (plain prompts, queries alone, MT-bench questions, chats ending with
    the user's turn): a run recorded as a regeneration of nothing would export no `previous`
    and judge no answer against an old one."""
    shapes = "; ".join(f"{r.file} read as {r.shape}: old answer {r.answer}" for r in readings)
    return (
        f"{source}: --regenerate, but none of its prompts has an old answer to replace"
        + (f" ({shapes})" if shapes else "")
        + ": stage it without --regenerate, or name the old answer's field with --answer-col"
    )


def new_identity(
    settings: Settings, params: GenerationParams, source: str, options: ReaderOptions
) -> RunIdentity:
    """What enqueueing `source` with `settings` would make of a run."""
    ref = model_ref(settings)
    return RunIdentity(
        fingerprint=fingerprint_source(source, options),
        params=params.model_dump(),
        staging=staging_params(settings),
        model=ref.model,
        engine=ref.engine,
        source=str(source),
    )


def mismatch_message(run: str, differences: list[str], resumed: bool = False) -> str:
    lines = "\n".join(f"  {line}" for line in differences)
    if resumed:
        return (
            f"run {run!r} was staged with other settings than those given now:\n{lines}\n"
            f"Nothing was enqueued. A run keeps the model and settings it was staged with: "
            f"leave these unset (flag, GENFLEET_* variable or settings file) to go on with it, "
            f"or stage the data as a new run (--run NEW)."
        )
    return (
        f"run {run!r} exists with other inputs or settings:\n{lines}\n"
        f"Nothing was staged or enqueued. Give this data its own run (--run NEW), or remove the "
        f"old one first (`genfleet delete {run}`)."
    )


def check_identity(
    manifest: Manifest,
    settings: Settings,
    params: GenerationParams,
    source: str,
    options: ReaderOptions,
) -> None:
    """Raise RunMismatch naming every difference between the run and what is asked now
    (with `--change-params`, other generation parameters are no difference: `changed_params`
    says which, and the enqueue records them)."""
    asked = new_identity(settings, params, source, options)
    if settings.change_params:
        asked = dataclasses.replace(asked, params=_unchangeable(manifest, asked.params))
    differences = manifest.identity().differences(asked)
    if manifest.version < IDENTITY_VERSION:
        differences.insert(
            0, f"the run was staged by an older genfleet (manifest v{manifest.version})"
        )
    if differences:
        raise RunMismatch(mismatch_message(manifest.run, differences))


# Settings that choose the model a run's orders go to (see `model_ref`).
_TARGET_SETTINGS = frozenset(
    {"model", "served_model_name", "engine", "engine_url", "engine_command"}
)
# Generation parameters whose setting has another name.
_PARAM_SETTINGS = {"response_format": "json_schema"}


def check_resumed(manifest: Manifest, settings: Settings, params: GenerationParams) -> None:
    """For an enqueue without a SOURCE (`--resume`, `retry`): raise RunMismatch when a setting
    that was given (flag, environment or settings file) asks for another model, generation
    parameter or batching than the run recorded. The run's orders always go out as recorded;
    this refuses to let a user believe otherwise. Settings left at their defaults ask nothing.
    """
    given = settings.model_fields_set
    recorded = manifest.identity()
    params_asked = {
        name: value
        for name, value in params.model_dump().items()
        if _PARAM_SETTINGS.get(name, name) in given
    }
    staging_asked = {k: v for k, v in staging_params(settings).items() if k in given}
    asked = dataclasses.replace(
        recorded,
        params={**recorded.params, **params_asked},
        staging={**recorded.staging, **staging_asked},
    )
    if given & _TARGET_SETTINGS:
        ref = model_ref(settings)
        asked = dataclasses.replace(asked, model=ref.model, engine=ref.engine)
    if settings.change_params:
        asked = dataclasses.replace(asked, params=_unchangeable(manifest, asked.params))
    differences = recorded.differences(asked)
    if differences:
        raise RunMismatch(mismatch_message(manifest.run, differences, resumed=True))


# The generation parameters `--change-params` may change for the rest of a run: plain values
# every work order carries (a response format or template arguments change what an answer is).
CHANGEABLE = frozenset(
    {"max_tokens", "temperature", "top_p", "thinking", "top_k", "min_p", "repetition_penalty"}
)


def _unchangeable(manifest: Manifest, asked: dict[str, Any]) -> dict[str, Any]:
    """`asked` with the changeable parameters taken as the run's (they are not compared)."""
    recorded = manifest.identity().params
    return {k: recorded.get(k) if k in CHANGEABLE else v for k, v in asked.items()}


def changed_params(
    manifest: Manifest, settings: Settings, params: GenerationParams, resumed: bool
) -> dict[str, Any]:
    """With `--change-params`: the changeable parameters asked now that differ from the
    run's (for a resume, only those given as a flag, variable or settings file)."""
    if not settings.change_params:
        return {}
    recorded = manifest.identity().params
    given = settings.model_fields_set
    return {
        name: value
        for name, value in params.model_dump().items()
        if name in CHANGEABLE
        and recorded.get(name) != value
        and (not resumed or _PARAM_SETTINGS.get(name, name) in given)
    }


def existing_run(
    settings: Settings,
    params: GenerationParams,
    run: str,
    source: str,
    options: ReaderOptions,
) -> Manifest | None:
    """The run's manifest when it exists and is what `source` with `settings` would make of it;
    None when there is no such run; RunMismatch when it differs. Reads the store only."""
    store = store_of(settings)
    manifest = Manifest.load(store, keys.validate_run(run))
    if manifest is not None:
        check_identity(manifest, settings, params, source, options)
    return manifest


def run_model(manifest: Manifest) -> ModelRef:
    """The model a staged run's orders go to; refused for a manifest that never recorded one."""
    if manifest.model is None or manifest.engine is None:
        raise RunMismatch(
            f"run {manifest.run!r} was staged by an older genfleet without a model: its orders "
            f"cannot be routed. Stage it again as a new run (--run NEW)."
        )
    return ModelRef(manifest.engine, manifest.model)


def claim_run(
    store: Store,
    run: str,
    params: GenerationParams,
    ref: ModelRef,
    staging: dict[str, Any],
    fingerprint: str | None,
    source: str,
    locate: Callable[[], str | None] | None = None,
) -> str:
    """Bind a run to its prompts, model and parameters before its first batch is staged, so
    that an interrupted staging is never finished with other data or settings (its inputs,
    checkpoints and outstanding orders would mix both): a claim that differs is refused
    (RunMismatch naming each difference). Returns the claim's staging id, which every work
    order of the run carries; staging the same data again keeps it.

    A claim of an older genfleet recorded no fingerprint: it cannot be checked, so it is
    refused too (`genfleet delete RUN` removes it). So is an interrupted staging of a stream
    (`fingerprint` None, `is_stream`): what it staged can never be compared with what the
    stream gives now. `locate`, called only when the prompts differ, says where
    (`first_difference`).
    """
    claim = RunIdentity(
        fingerprint or STREAM_FINGERPRINT,
        params.model_dump(),
        staging,
        ref.model,
        ref.engine,
        source,
    )
    raw = store.get(keys.claim_key(run))
    if raw is not None:
        data = orjson.loads(raw)
        older = "(not recorded by this older claim)"
        before = RunIdentity(
            data.get("fingerprint") or (STREAM_FINGERPRINT if data.get("staging_id") else older),
            data["params"],
            data["staging"],
            data["model"],
            data["engine"],
            data.get("source") or "",
        )
        differences = before.differences(claim)
        unknown = fingerprint is None or not data.get("fingerprint")
        if unknown:
            differences.append(
                "the staging read a stream (a named pipe or device), which can be read once: "
                "what it staged cannot be compared with the data given now"
            )
        elif before.fingerprint != fingerprint and locate is not None:
            where = locate()
            if where:
                differences.insert(1, where)
        if differences or not data.get("staging_id"):
            raise RunMismatch(interrupted_message(run, differences))
        return str(data["staging_id"])
    staging_id = secrets.token_hex(16)
    body = {
        "params": claim.params,
        "staging": staging,
        "model": ref.model,
        "engine": ref.engine,
        "fingerprint": fingerprint,
        "source": source,
        "staging_id": staging_id,
    }
    store.put(keys.claim_key(run), orjson.dumps(body))
    return staging_id


def first_difference(
    store: Store, run: str, source: str, options: ReaderOptions, settings: Settings
) -> str | None:
    """Where `source`, batched as `settings` say, first differs from the batches an
    interrupted staging of `run` left in the store: the batch and prompt id, or that every
    staged batch matches and the data differs after them. Reads the source once more; only
    a refusal calls it."""
    from genfleet.producer.batching import make_batches

    records = (item for item in read_source(source, options) if not isinstance(item, Reject))
    batches = make_batches(
        records,
        settings.batch_size,
        settings.batch_max_tokens,
        settings.max_tokens,
        settings.batch_tail,
    )
    for index, batch in enumerate(batches):
        staged = store.get(keys.input_key(run, keys.batch_id(index)))
        if staged is None:
            if not index:
                return None
            return (
                f"first difference: after the {index} batches staged so far, which hold "
                f"the same prompts"
            )
        lines = gzip.decompress(staged).splitlines()
        for position, record in enumerate(batch):
            if position >= len(lines) or lines[position] != orjson.dumps(record.to_json()):
                return (
                    f"first difference: {keys.batch_id(index)}, prompt {record.id!r} "
                    f"(sample {record.sample})"
                )
        if len(lines) != len(batch):
            return f"first difference: {keys.batch_id(index)} staged {len(lines)} prompts"
    return None


def interrupted_message(run: str, differences: list[str]) -> str:
    lines = "\n".join(f"  {line}" for line in differences) or "  (an older claim: unchecked)"
    return (
        f"run {run!r} has an interrupted staging (no manifest yet) of other inputs or "
        f"settings:\n{lines}\n"
        f"Nothing was staged or enqueued. Stage this data as its own run (--run NEW), run the "
        f"same command with the data it was staged with to finish it, or remove it first "
        f"(`genfleet delete {run}`)."
    )
