"""Record types on the path of a prompt, and their JSON lines encoding.

PromptRecord (read from a dataset, staged in batches in the store) → WorkOrder (the Celery
message, a claim check naming the staged batch) → CompletionRecord (one line per prompt in the
batch's output object). Dataclasses with slots on the hot path; validation happens where data
enters (readers, the task's message), not per request.
"""

from __future__ import annotations

import gzip
import hashlib
from collections.abc import Iterable, Iterator
from dataclasses import asdict, dataclass, field
from typing import Any

import orjson
from pydantic import BaseModel, ConfigDict, field_validator, model_validator

from genfleet.common.keys import input_key, validate_batch, validate_run

ROLES = frozenset({"system", "user", "assistant", "tool", "developer"})


@dataclass(slots=True)
class PromptRecord:
    """One prompt of a run: its id, chat messages, sample index and per-prompt overrides."""

    id: str
    messages: list[dict[str, Any]]
    sample: int = 0
    params: dict[str, Any] | None = None  # per-line overrides (OpenAI batch `body`)
    custom_id: str | None = None  # the source's own id, kept for OpenAI batch output
    # --regenerate: the answer this prompt's new one replaces, `{"content", "reasoning"}`.
    # Staged with the prompt and copied to the output record by the worker; never sent.
    previous: dict[str, str | None] | None = None

    def to_json(self) -> dict[str, Any]:
        data: dict[str, Any] = {"id": self.id, "messages": self.messages}
        if self.sample:
            data["sample"] = self.sample
        if self.params:
            data["params"] = self.params
        if self.custom_id is not None:
            data["custom_id"] = self.custom_id
        if self.previous is not None:
            data["previous"] = self.previous
        return data

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> PromptRecord:
        return cls(
            id=data["id"],
            messages=data["messages"],
            sample=data.get("sample", 0),
            params=data.get("params"),
            custom_id=data.get("custom_id"),
            previous=data.get("previous"),
        )

    @property
    def key(self) -> tuple[str, int]:
        """(id, sample): the identity an export deduplicates on."""
        return (self.id, self.sample)


class GenerationParams(BaseModel):
    """Run-wide sampling parameters; an OpenAI batch line may override them per prompt.

    The optional ones are sent only when set (None: the engine's own default). A field this
    model does not know is refused (`extra="forbid"`), so a worker never runs an order with a
    parameter it would drop.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    max_tokens: int
    temperature: float
    top_p: float
    thinking: bool
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    response_format: dict[str, Any] | None = None  # --json-schema FILE: a json_schema format
    chat_template_kwargs: dict[str, Any] | None = None
    # False: the worker's repetition guard does not watch these answers (`genfleet retry
    # --stopped --no-repetition-guard`: a second chance for answers it stopped); None: the
    # worker's own `repetition_guard` setting decides. Never sent to the engine.
    repetition_guard: bool | None = None


class WorkOrder(BaseModel):
    """The Celery message body: which staged batch to generate. JSON, small, validated.

    It carries the run's sampling parameters so a worker never reads the manifest, and the
    model (with the engine kind) it must be generated with: a worker serving another model
    hands it back to its own queue (`genfleet.common.routing.order_queue`).

    The staged input's key is derived from (run, batch), never taken from the message: a
    message naming another run's input (anyone who can send a task can write one) is refused,
    so run A's outputs are never built from run B's prompts. `input_sha256` (`batch_digest`
    of the staged lines) and `staging` (the run's staging id, from its claim) bind the order
    to the one staging it was issued for: a worker refuses an input that does not match and
    drops an order of a staging that was superseded (the run deleted or staged anew). Both
    are empty only in orders of an older genfleet, which are not checked.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    run: str
    batch: str
    key: str = ""
    params: GenerationParams
    model: str
    engine: str
    prompts: int = 0
    enqueued_at: float = 0.0
    # The run's response_format, stored once in the store (keys.response_format_key) in place
    # of `params.response_format`; the worker reads it and checks its sha256.
    response_format_key: str | None = None
    response_format_sha256: str | None = None
    input_sha256: str = ""
    staging: str = ""

    @model_validator(mode="before")
    @classmethod
    def _derived_key(cls, data: Any) -> Any:
        if isinstance(data, dict) and isinstance(data.get("run"), str):
            derived = input_key(str(data["run"]), str(data.get("batch")))
            given = data.get("key")
            if given not in (None, "", derived):
                raise ValueError(
                    f"key {given!r} is not the staged input of {data['run']}/"
                    f"{data.get('batch')} ({derived}): refused"
                )
            data = {**data, "key": derived}
        return data

    @field_validator("run")
    @classmethod
    def _run(cls, value: str) -> str:
        return validate_run(value)

    @field_validator("batch")
    @classmethod
    def _batch(cls, value: str) -> str:
        return validate_batch(value)


@dataclass(slots=True)
class Usage:
    prompt_tokens: int = 0
    completion_tokens: int = 0
    reasoning_tokens: int = 0


@dataclass(slots=True)
class CompletionRecord:
    """One output line: what was asked, what came back, and how (engine, tokens, latency).

    `error` is None for a completion, `{"type", "message"}` for a prompt the engine refused
    (too long, bad parameters): an error record still counts the prompt as done. An answer the
    repetition guard stopped has `finish_reason "repetition"`: done, but never a kept answer.
    """

    id: str
    run: str
    batch: str
    messages: list[dict[str, Any]]
    reasoning: str | None
    content: str | None
    finish_reason: str | None
    usage: Usage = field(default_factory=Usage)
    model: str | None = None
    engine: dict[str, Any] = field(default_factory=dict)
    latency_s: float = 0.0
    error: dict[str, str] | None = None
    sample: int = 0
    custom_id: str | None = None
    request_id: str | None = None
    logprobs: Any = None  # the choice's logprobs, when the request asked for them
    # --regenerate: the old answer this one replaces (see PromptRecord.previous); the key is
    # left out of the JSON of records that have none.
    previous: dict[str, str | None] | None = None
    # sha256 of the prompt's staged line (`line_digests`): a checkpoint row stands as the
    # result of the staged prompt only when this matches, and export checks it against the
    # manifest. None only in records of an older genfleet.
    prompt_sha256: str | None = None
    # finish_reason "repetition": the loop the guard stopped (field, start_char,
    # start_token_estimate, block_chars (its period), repeats, block (its first characters),
    # rule, chars, completion_tokens, tokens_saved); None otherwise.
    repetition: dict[str, Any] | None = None
    # Tokens of this answer drawn before a cut (an engine death, a worker lost) that it went
    # on from by their ids: the answer is the model's, not started over.
    resumed_tokens: int = 0
    # An answer that had to start over after a cut: {"tokens": thrown away, "reason": why it
    # could not go on (penalties, a grammar, an engine without token ids)}; None otherwise.
    restarted: dict[str, Any] | None = None

    def to_json(self) -> dict[str, Any]:
        data = asdict(self)
        for name in ("previous", "restarted"):
            if data[name] is None:
                del data[name]
        if not data["resumed_tokens"]:
            del data["resumed_tokens"]
        return data

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> CompletionRecord:
        data = dict(data)
        data["usage"] = Usage(**(data.get("usage") or {}))
        return cls(**data)


def response_format_bytes(response_format: dict[str, Any]) -> bytes:
    """A response format as the store holds it, and as its hash is taken (sorted keys)."""
    return orjson.dumps(response_format, option=orjson.OPT_SORT_KEYS)


def line_digests(raw: bytes) -> list[str]:
    """The sha256 of each JSON line of a staged batch (uncompressed), in order: the identity
    of each prompt as staged, which a checkpoint row must carry to stand as its result."""
    return [hashlib.sha256(line).hexdigest() for line in raw.splitlines() if line.strip()]


def batch_digest(digests: Iterable[str]) -> str:
    """A staged batch's content hash: sha256 over its prompts' line digests, in order. The
    manifest records it per batch, every work order carries it, and it is computed again
    from an output's rows (each names its prompt's digest) when the run is exported."""
    return hashlib.sha256("\n".join(digests).encode()).hexdigest()


def dumps_jsonl(rows: Iterable[dict[str, Any]]) -> bytes:
    return b"".join(orjson.dumps(row) + b"\n" for row in rows)


def encode_jsonl_gz(rows: Iterable[dict[str, Any]]) -> bytes:
    """Gzip'd JSON lines; level 6 is the usual size/speed balance for text."""
    return gzip.compress(dumps_jsonl(rows), compresslevel=6, mtime=0)


def decode_jsonl_gz(data: bytes) -> Iterator[dict[str, Any]]:
    for line in gzip.decompress(data).splitlines():
        if line.strip():
            yield orjson.loads(line)
