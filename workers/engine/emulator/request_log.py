"""The request log (`--emulator-request-log`): one JSON line per request the engine got, in one
shape whichever route it came by, so a test (or a soak's accounting, `harness/resends.py`)
reads what was asked without knowing how it was sent.

    {"body": {...}, "outcome": "ok" | "abort" | "429" | "400" | "503" | "crash", "id": rid,
     "endpoint": "/v1/chat/completions" | "/generate", "drawn_tokens": k,
     "in_engine": n, "ts": wall-clock seconds}

A chat request's `body` is the request as sent. A `/generate` request's is the chat request it
stands for: the `model`, `messages` and `chat_template_kwargs` (and `tools`,
`reasoning_effort`) its prompt ids were rendered from by `/v1/tokenize`, and its
sampling_params under the chat API's names, counted over the whole answer (`max_tokens` =
`max_new_tokens` + the `k` output ids it went on from, `min_tokens` likewise, `seed` from
`sampling_seed`). `drawn_tokens` is that `k` (0: the answer's first request). The tokenize
route remembers what it rendered (the last RENDERINGS_KEPT prompts, by a digest of their ids);
prompt ids it never rendered (a `text` prompt, ids from elsewhere, or a rendering long
forgotten) are logged as their decoded text in one user message, with `messages_decoded`
true. Tokenize requests generate nothing and are not logged.

Nothing is remembered or written when no log is kept: the benchmark's hot path pays nothing.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from collections.abc import Callable
from typing import Any, BinaryIO

import orjson

RENDERINGS_KEPT = 65_536
# The tokenize request's fields that decide its rendering (and `model`, which the chat
# request it stands for names).
RENDERED_FIELDS = ("model", "messages", "chat_template_kwargs", "tools", "reasoning_effort")
# sampling_params names → the chat API's; the others are the same in both.
CHAT_NAMES = {
    "max_new_tokens": "max_tokens",
    "min_new_tokens": "min_tokens",
    "sampling_seed": "seed",
}
# Counts over this request's output → over the whole answer.
OVER_THE_ANSWER = ("max_new_tokens", "min_new_tokens")
CHAT_ENDPOINT = "/v1/chat/completions"
GENERATE_ENDPOINT = "/generate"


def ids_key(ids: list[int]) -> bytes:
    """A digest of a prompt's ids: the renderings are keyed by it, not by the ids themselves
    (65,536 prompts of a few thousand ids would hold gigabytes)."""
    try:
        raw = array("q", ids).tobytes()
    except OverflowError:  # an id beyond 64 bits: never a rendered prompt's, never crash
        raw = repr(ids).encode()
    return hashlib.blake2b(raw, digest_size=16).digest()


class RequestLog:
    """The log file, and the renderings it needs to say what a `/generate` request asked."""

    def __init__(self, path: str, kept: int = RENDERINGS_KEPT) -> None:
        self._file: BinaryIO | None = open(path, "ab")  # noqa: SIM115 (closed by `close`)
        self._kept = kept
        self._renderings: OrderedDict[bytes, dict[str, Any]] = OrderedDict()

    def remember(self, ids: list[int], request: dict[str, Any]) -> None:
        """The tokenize route rendered `request`'s messages to `ids`."""
        fields = {name: request[name] for name in RENDERED_FIELDS if name in request}
        key = ids_key(ids)
        self._renderings[key] = fields
        self._renderings.move_to_end(key)
        while len(self._renderings) > self._kept:
            self._renderings.popitem(last=False)

    def generate_entry(
        self,
        prompt_ids: list[int],
        drawn: int,
        request: dict[str, Any],
        sampling: dict[str, Any],
        decode: Callable[[list[int]], str],
    ) -> dict[str, Any]:
        """The log entry of one `/generate` prompt (`prompt_ids`, then `drawn` output ids),
        less its outcome and id."""
        fields = self._renderings.get(ids_key(prompt_ids))
        decoded = fields is None
        if fields is None:
            fields = {"messages": [{"role": "user", "content": decode(prompt_ids)}]}
        body = {**fields, **chat_sampling(sampling, drawn)}
        if "stream" in request:
            body["stream"] = request["stream"]
        return {
            "body": body,
            "endpoint": GENERATE_ENDPOINT,
            "drawn_tokens": drawn,
            "messages_decoded": decoded,
        }

    def write(self, entry: dict[str, Any]) -> None:
        if self._file is not None:
            self._file.write(orjson.dumps(entry) + b"\n")
            self._file.flush()

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None


def chat_sampling(sampling: dict[str, Any], drawn: int) -> dict[str, Any]:
    """A `/generate` request's sampling_params as the chat request's fields, its counts over
    the whole answer (`drawn` ids went before this request).

    >>> chat_sampling({"max_new_tokens": 90, "sampling_seed": 7, "top_k": 20}, 10)
    {'max_tokens': 100, 'seed': 7, 'top_k': 20}
    """
    out: dict[str, Any] = {}
    for name, value in sampling.items():
        if name in OVER_THE_ANSWER and isinstance(value, int) and not isinstance(value, bool):
            value += drawn
        out[CHAT_NAMES.get(name, name)] = value
    return out
