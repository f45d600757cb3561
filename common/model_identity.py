"""A model's identity: what a run asks for, recorded where the run is made, and whether the
model a worker serves is it.

The producer records it as it stages the run, before the run's first order is sent
(`record`, `RUN/model.json`, write-once; a retry round copies its run's), so no worker decides
a run's model by being the first to take one of its orders:

- the engine kind and the name its orders carry (`routing.model_ref`: the queue);
- the checkpoint `--model` names and, where the producer can read that folder, its content
  digest (`common.checkpoint_digest`); a hub id, or a path the producer cannot read, is
  recorded as a name only. The emulator is a model of its own whatever `--model` says: no
  checkpoint;
- what changes answers under one name, as asked: `--quantization` among the engine's extra
  args, `--reasoning-parser`, `--thinking-switch` (None: the checkpoint's own). The emulator
  is judged on these too, so a dry run refuses what the fleet would.

A worker compares what it serves with that record once per run and staging (`judge`, pure,
table-tested):

    record            worker             verdict
    content A         content A          serves (the same snapshot at two paths is one model)
    content A         content B          refused: checkpoint content
    content A         a name only        by name: content cannot be compared, said so
    name X            name X / none      by name
    name X            name Y             refused: checkpoint (names only)
    asks None         its own default    serves;  asks None, overridden: refused
    asks fp8          serves fp8         serves;  serves another: refused
    none at all       anything           by name (a run staged before runs recorded their model)

A worker that does not serve the run's model hands the run's orders back and goes on with
other runs' (workers/admission.py); it notes why here (`note_refusal`: a hash per run that
expires after the refusal memory), and `status` says the run's orders are held when every
worker consuming its queue refused it. A record an older genfleet's first worker wrote (its
resolved fields, no `version`) is compared field by field as it was then.
"""

from __future__ import annotations

import shlex
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import orjson

from genfleet.common import keys
from genfleet.common.checkpoint_digest import digest
from genfleet.common.errors import RunMismatch
from genfleet.common.redis_conn import RedisCommands, text
from genfleet.common.routing import EMULATOR, model_ref
from genfleet.common.settings import Settings
from genfleet.common.store import Store

UNRECORDED = (
    "the run records no model beyond the name its orders carry (staged before runs recorded "
    "their model)"
)
VERSION = 2  # records without it were written by a run's first worker (an older genfleet)
KNOBS = ("quantization", "reasoning_parser", "thinking_switch")
# The fields an older genfleet's first worker recorded, compared one by one.
LEGACY_FIELDS = (
    "engine",
    "model",
    "config_sha256",
    "weights_index_sha256",
    "quantization",
    "reasoning_parser",
    "thinking_switch",
    "thinking_default",
)


def flag_values(args: Sequence[str], name: str) -> list[str]:
    """Every value `name` is given among an engine's `args` (`name X` or `name=X`), in order
    (SGLang's argparse takes the last)."""
    values = []
    for i, arg in enumerate(args):
        if arg == name and i + 1 < len(args):
            values.append(args[i + 1])
        elif arg.startswith(name + "="):
            values.append(arg.split("=", 1)[1])
    return values


def quantization_flag(extra_args: str | None) -> str | None:
    """`--quantization X` (or `--quantization=X`) among the engine's extra args; None: none."""
    values = flag_values(shlex.split(extra_args or ""), "--quantization")
    return values[0] if values else None


def checkpoint_of(settings: Settings) -> tuple[str | None, str | None]:
    """The checkpoint these settings name, and its content digest where it is a folder here
    (None: a name only); (None, None) for the emulator or where no `--model` is given."""
    if settings.engine_kind == EMULATOR or not settings.model:
        return None, None
    return settings.model, digest(Path(settings.model).expanduser())


def asked(settings: Settings) -> dict[str, Any]:
    """The model a run staged with these settings asks for: what `record` writes."""
    ref = model_ref(settings)
    checkpoint, content = checkpoint_of(settings)
    return {
        "version": VERSION,
        "engine": ref.engine,
        "model": ref.model,
        "checkpoint": checkpoint,
        "content_sha256": content,
        "asks": {
            "quantization": quantization_flag(settings.engine_extra_args),
            "reasoning_parser": settings.reasoning_parser,
            "thinking_switch": settings.thinking_switch,
        },
    }


def read(store: Store, run: str) -> dict[str, Any] | None:
    """The run's recorded model; None for a run staged before runs recorded one."""
    raw = store.get(keys.model_key(run))
    if raw is None:
        return None
    data = orjson.loads(raw)
    return data if isinstance(data, dict) else None


def record(store: Store, run: str, model: dict[str, Any]) -> None:
    """Record the run's model, once: the producer, as it stages the run (a retry round, its
    run's record). Staging an interrupted run again with another model is refused
    (RunMismatch naming each difference), never recorded over."""
    if store.put_if_absent(keys.model_key(run), orjson.dumps(model, option=orjson.OPT_SORT_KEYS)):
        return
    recorded = read(store, run)
    if recorded == model:
        return
    found = record_differences(recorded or {}, model)
    lines = "\n".join(f"  {line}" for line in found or ["the recorded model cannot be read"])
    raise RunMismatch(
        f"run {run!r} was staged for another model than asked now:\n{lines}\nNothing was "
        f"staged. Stage it with the settings it was staged with, or as a new run (--run NEW)."
    )


def withdraw(store: Store, run: str) -> None:
    """A staging that staged nothing takes its record back with its claim: the run does not
    exist, and may be staged again with other settings."""
    store.delete_prefix(keys.model_key(run))


def record_differences(old: dict[str, Any], new: dict[str, Any]) -> list[str]:
    """`field: the run has X, now Y` for each field of two records that differs."""
    flat_old = {**old, **(old.get("asks") or {})}
    flat_new = {**new, **(new.get("asks") or {})}
    names = ("engine", "model", "checkpoint", "content_sha256", *KNOBS)
    return [
        f"{name}: the run has {flat_old.get(name)!r}, now {flat_new.get(name)!r}"
        for name in names
        if flat_old.get(name) != flat_new.get(name)
    ]


@dataclass(frozen=True, slots=True)
class Verdict:
    """Whether a worker serves a run's model: how it was compared (`content`: the checkpoints'
    digests; `name`: names only), what differs (empty: it serves it), and why the content was
    not compared, when it was not."""

    serves: bool
    compared: Literal["content", "name"]
    differences: tuple[str, ...] = ()
    note: str = ""

    def why(self) -> str:
        """`quantization: the run asks …, this worker serves 'fp8'; …` (by content or name)."""
        found = "; ".join(self.differences) or "the same model"
        note = f"; {self.note}" if self.note else ""
        return f"{found} (checkpoint compared by {self.compared}{note})"

    def to_json(self) -> dict[str, Any]:
        return {
            "serves": self.serves,
            "compared": self.compared,
            "differences": list(self.differences),
            "note": self.note,
        }


def judge(recorded: dict[str, Any] | None, mine: dict[str, Any]) -> Verdict:
    """Whether the worker whose identity is `mine` (`workers.engine.fingerprint`) serves the
    model `recorded` for the run (`read`). Pure: the module docstring has the table."""
    if recorded is None:
        return Verdict(True, "name", (), UNRECORDED)
    if recorded.get("version") != VERSION:
        return _judge_legacy(recorded, mine)
    found = [
        f"{name}: the run asks {recorded.get(name)!r}, this worker serves {mine.get(name)!r}"
        for name in ("engine", "model")
        if recorded.get(name) != mine.get(name)
    ]
    compared, note, checkpoint = _checkpoints(recorded, mine)
    found += checkpoint
    found += _knobs(recorded.get("asks") or {}, mine.get("serves") or {})
    return Verdict(not found, compared, tuple(found), note)


def _checkpoints(
    recorded: dict[str, Any], mine: dict[str, Any]
) -> tuple[Literal["content", "name"], str, list[str]]:
    """How the checkpoints compare: by content where both digests are known, else by name."""
    theirs, ours = recorded.get("content_sha256"), mine.get("content_sha256")
    run_name, my_name = recorded.get("checkpoint"), mine.get("checkpoint")
    if theirs and ours:
        if theirs == ours:
            return "content", "", []
        return (
            "content",
            "",
            [
                f"checkpoint content: the run's {run_name!r} is {theirs[:12]}, this worker's "
                f"{my_name!r} is {ours[:12]}"
            ],
        )
    if theirs or ours:
        unread = (
            f"the run records {run_name!r} by name only (the producer could not read it)"
            if not theirs
            else f"this worker's {my_name!r} is a name only (a hub id, or a path it cannot read)"
        )
        name = recorded.get("model")
        return "name", f"content not compared, {unread}: judged by the name {name!r}", []
    if run_name and my_name and run_name != my_name:
        return (
            "name",
            "",
            [f"checkpoint: the run names {run_name!r}, this worker {my_name!r} (names only)"],
        )
    return "name", "", []


def _knobs(asks: dict[str, Any], serves: dict[str, Any]) -> list[str]:
    """Each knob the worker serves otherwise than the run asks: the run's value, or where it
    asked none, the worker's own default (the checkpoint's quantization, its family's parser
    and switch)."""
    found = []
    for knob in KNOBS:
        asked_value = asks.get(knob)
        mine = serves.get(knob) or {}
        value, default = mine.get("value"), mine.get("default")
        want = default if asked_value is None else asked_value
        if value != want:
            what = repr(asked_value) if asked_value is not None else f"its own ({default!r})"
            found.append(f"{knob}: the run asks {what}, this worker serves {value!r}")
    return found


def _judge_legacy(recorded: dict[str, Any], mine: dict[str, Any]) -> Verdict:
    found = tuple(
        f"{name}: the run has {recorded.get(name)!r}, this worker {mine.get(name)!r}"
        for name in LEGACY_FIELDS
        if recorded.get(name) != mine.get(name)
    )
    by_content = bool(recorded.get("config_sha256") and mine.get("config_sha256"))
    note = "recorded by the run's first worker (an older genfleet)"
    return Verdict(not found, "content" if by_content else "name", found, note)


def note_refusal(
    client: RedisCommands, run: str, worker: str, staging: str, verdict: Verdict, memory_s: float
) -> None:
    """A worker refuses the run: why, for `status`. The hash lives twice `memory_s` (the
    worker's refusal memory) after the last refusal noted in it: a worker that still refuses
    the run judges it again, and notes it again, once its memory of it lapses."""
    entry = {"why": verdict.why(), "staging": staging, **verdict.to_json()}
    pipe = client.pipeline()
    pipe.hset(keys.model_refusals_key(run), worker, orjson.dumps(entry))
    pipe.pexpire(keys.model_refusals_key(run), max(int(2 * memory_s * 1000), 1))
    pipe.execute()


def clear_refusal(client: RedisCommands, run: str, worker: str) -> None:
    """A worker serves the run (restarted with the run's model, say): its refusal goes."""
    client.hdel(keys.model_refusals_key(run), worker)


def refusals(client: RedisCommands, run: str) -> dict[str, dict[str, Any]]:
    """Worker → its refusal of the run (`why`, `differences`, `compared`, `staging`)."""
    found: dict[str, dict[str, Any]] = {}
    for worker, raw in (client.hgetall(keys.model_refusals_key(run)) or {}).items():
        try:
            entry = orjson.loads(raw)
        except orjson.JSONDecodeError:
            continue
        if isinstance(entry, dict):
            found[text(worker)] = entry
    return found
