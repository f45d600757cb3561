"""The engine client's wire: one POST of a chat request, its answer fed to a sink line by line.

`EngineClient` (workers/feeding/client.py) builds the request and maps every answer; how the bytes
travel is this seam's. `AiohttpTransport` is the one a worker uses; a test hands the client a
scripted one (`tests/fakes/transport.py`) that passes the same contract tests, so the
client's answer mapping is tested in process and one set of tests holds the real HTTP path.

A transport's failures are genfleet's already: a request that never connected is
EngineUnreachable, one past its deadline RequestTimedOut, anything else on the wire
EngineDown. A non-200 answer is not a failure here: it comes back as (status, body,
Retry-After) for the client to map.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Iterator
from typing import Protocol

import aiohttp
from yarl import URL

from genfleet.common.errors import EngineDown, EngineUnreachable, RequestTimedOut

# (status, body, Retry-After): the body is empty once it was streamed into the sink
Reply = tuple[int, bytes, str | None]
DRAIN_S = 1.0  # how long the end of a finished stream's body is waited for


class Sink(Protocol):
    """What reads an answer's event stream (`workers.feeding.stream.ChatStream`)."""

    @property
    def done(self) -> bool:
        """Whether the stream's end (`data: [DONE]`) arrived."""
        ...

    def feed(self, line: bytes) -> bool:
        """One line of the body; True once the answer must stop (a loop, an error, the end)."""
        ...


class Transport(Protocol):
    """POSTs one chat request and streams its answer into a sink."""

    async def stream(self, body: bytes, sink: Sink, timeout_s: float | None = None) -> Reply:
        """POST `body`; a 200 event stream is fed to `sink` until it says stop or ends (the
        connection closed at once when it stops early: SGLang aborts a request whose client
        is gone) and comes back with an empty body; a 200 that is not an event stream (a
        server that does not stream) and any other status come back whole. `timeout_s` is
        the request's deadline, else the transport's."""
        ...

    async def aclose(self) -> None:
        """Close the connections; called once, when the client is done."""
        ...


@contextlib.contextmanager
def _transport_errors(timeout: aiohttp.ClientTimeout) -> Iterator[None]:
    """aiohttp's failures as genfleet's, in one place (the module docstring's map)."""
    try:
        yield
    except (aiohttp.ConnectionTimeoutError, aiohttp.ClientConnectorError) as exc:
        raise EngineUnreachable(f"engine unreachable: {exc.__class__.__name__}: {exc}") from exc
    except TimeoutError as exc:
        raise RequestTimedOut(
            f"request timed out after {timeout.total:.0f} s: {exc.__class__.__name__}"
        ) from exc
    except aiohttp.ClientError as exc:
        raise EngineDown(f"engine unreachable: {exc.__class__.__name__}: {exc}") from exc


class AiohttpTransport:
    """One aiohttp session, a keep-alive pool, a prebuilt URL. With a pool of a few hundred
    connections aiohttp sustains ~10x httpx's request rate on one core."""

    def __init__(
        self, url: str, headers: dict[str, str], timeout_s: float, max_connections: int
    ) -> None:
        self._url = URL(url)
        self._headers = headers
        self._timeout = aiohttp.ClientTimeout(total=timeout_s, connect=10.0)
        self._max_connections = max_connections
        self._session: aiohttp.ClientSession | None = None

    def _open(self) -> aiohttp.ClientSession:
        """Made on first use, inside the loop that will run every request."""
        connector = aiohttp.TCPConnector(
            limit=self._max_connections, ttl_dns_cache=None, keepalive_timeout=60.0
        )
        self._session = aiohttp.ClientSession(
            connector=connector,
            timeout=self._timeout,
            headers=self._headers,
            auto_decompress=False,
        )
        return self._session

    async def stream(self, body: bytes, sink: Sink, timeout_s: float | None = None) -> Reply:
        session = self._session or self._open()
        timeout = self._timeout if timeout_s is None else self._deadline(timeout_s)
        with _transport_errors(timeout):
            async with session.post(self._url, data=body, timeout=timeout) as response:
                status = response.status
                if status != 200:
                    return status, await response.read(), response.headers.get("Retry-After")
                if response.content_type != "text/event-stream":
                    return status, await response.read(), None
                if not await _feed(response, sink):
                    return status, b"", None
                if not sink.done or not await _drained(response):
                    response.close()
                return status, b"", None

    def _deadline(self, timeout_s: float) -> aiohttp.ClientTimeout:
        return aiohttp.ClientTimeout(total=timeout_s, connect=self._timeout.connect)

    async def aclose(self) -> None:
        if self._session is not None:
            await self._session.close()


async def _drained(response: aiohttp.ClientResponse) -> bool:
    """Read the few bytes after `[DONE]` (the last separator, the chunked body's end), so that
    the connection goes back to the pool instead of closing; False when the server holds the
    body open past a moment (then it is closed: the answer is whole already)."""
    if response.content.at_eof():
        return True
    try:
        async with asyncio.timeout(DRAIN_S):  # a timer, not a task per answer (wait_for)
            await response.content.read()
    except (TimeoutError, aiohttp.ClientError):
        return False
    return True


async def _feed(response: aiohttp.ClientResponse, sink: Sink) -> bool:
    """Lines of the body to `sink` until it says stop (True) or the body ends (False).
    Split here rather than with `readline`, which caps a line at 128 KiB."""
    pending: list[bytes] = []
    async for data in response.content.iter_any():
        if b"\n" not in data:
            pending.append(data)
            continue
        if pending:
            data = b"".join((*pending, data))
            pending = []
        *lines, rest = data.split(b"\n")
        for line in lines:
            if line and sink.feed(line):  # blank lines only separate events
                return True
        if rest:
            pending.append(rest)
    if pending:
        return sink.feed(b"".join(pending))
    return False
