"""A transport whose answers a test scripts: `ScriptedTransport`, in place of aiohttp.

It passes the contract tests the real transport passes (`tests/workers/test_client.py` runs
them over both), so the engine client's answer mapping is tested in process: each request
takes the next scripted answer, a whole one (status, JSON body, Retry-After), an event
stream (its events, `data:`-framed as SGLang sends them; a generator may run forever; `CUT`
breaks it as a dying engine does), or an
exception a transport raises (EngineDown, RequestTimedOut, EngineUnreachable).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import orjson

from genfleet.common.errors import EngineDown
from genfleet.workers.feeding.transport import Reply, Sink


@dataclass
class Whole:
    """A whole answer: `body` (JSON unless bytes) with `status` and a Retry-After header."""

    status: int
    body: Any
    retry_after: str | None = None


@dataclass
class Events:
    """A 200 event stream of these events (JSON unless bytes, e.g. b"[DONE]")."""

    events: Iterable[Any]


class Cut:
    """An event of `Events`: the engine dies here, the connection broken mid-stream (as a
    killed engine's: the real transport sees a reset, raises EngineDown)."""


CUT = Cut()

Answer = Whole | Events | Exception


def encoded(payload: Any) -> bytes:
    return payload if isinstance(payload, bytes) else orjson.dumps(payload)


@dataclass
class ScriptedTransport:
    """Answers each request with the next of `answers`; records every request body and
    whether the client stopped a stream before its end (`closed_early`)."""

    answers: list[Answer]
    bodies: list[dict[str, Any]] = field(default_factory=list)
    closed_early: list[bool] = field(default_factory=list)
    closed: bool = False

    async def stream(self, body: bytes, sink: Sink, timeout_s: float | None = None) -> Reply:
        self.bodies.append(orjson.loads(body))
        answer = self.answers.pop(0)
        if isinstance(answer, Exception):
            raise answer
        if isinstance(answer, Whole):
            return answer.status, encoded(answer.body), answer.retry_after
        stopped = False
        for event in answer.events:
            if isinstance(event, Cut):
                raise EngineDown("engine unreachable: ClientPayloadError: the stream was cut")
            # SSE framing as SGLang writes it: the event line, then a blank separator
            if sink.feed(b"data: " + encoded(event)):
                stopped = True
                break
        self.closed_early.append(stopped and not sink.done)
        return 200, b"", None

    async def aclose(self) -> None:
        self.closed = True
