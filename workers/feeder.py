"""Keeping the engine full: one asyncio loop and one in-flight limiter per worker.

Every batch the worker runs (Celery threads pool, several at once) submits its prompts here.
They all wait on one FIFO semaphore sized a little above the engine's max_running_requests,
so while one batch's stragglers finish, the next batch's prompts already fill the engine and
its own queue never runs dry. The loop runs on a thread of its own; batch threads block on a
concurrent future.

A prompt the engine refuses (400) becomes an error record. When the engine goes down the
prompt waits for the supervisor to bring it back and is retried; if it cannot come back, the
batch fails and its finished prompts survive as a checkpoint.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Awaitable, Callable, Iterable
from concurrent.futures import Future
from typing import Any, Protocol, TypeVar

from genfleet.common.errors import EngineDown, RequestRejected
from genfleet.common.records import CompletionRecord, GenerationParams, PromptRecord
from genfleet.workers.client import ChatResult

log = logging.getLogger("genfleet.feeder")
T = TypeVar("T")


class EngineHandle(Protocol):
    """The supervisor (or an external engine) as the feeder sees it: wait for it to be up."""

    @property
    def state(self) -> str: ...

    def wait_up(self, timeout_s: float) -> None: ...


class ChatClient(Protocol):
    """What the feeder sends prompts through: `EngineClient`, or a fake in the unit tests."""

    model: str

    async def chat(self, record: PromptRecord, params: GenerationParams) -> ChatResult: ...

    async def aclose(self) -> None: ...


def retry_backoff_s(attempt: int) -> float:
    """Seconds before the `attempt`-th retry of a prompt whose engine went down: 0.5, 1, 2, 4,
    8, then 10 at most (the supervisor's own restart backoff runs meanwhile)."""
    return min(0.25 * 2.0**attempt, 10.0)


def default_max_inflight(max_running_requests: int | None) -> int:
    """A little above the engine's cap so its queue never runs dry between completions."""
    if not max_running_requests:
        return 64
    return int(max_running_requests * 1.25) + 4


class Feeder:
    """The worker's one loop and one limiter; `run_batch` is called from any thread."""

    def __init__(
        self,
        client_factory: Callable[[], ChatClient],
        engine: EngineHandle,
        max_inflight: int,
        *,
        retries: int = 5,
        engine_wait_s: float = 600.0,
        identity: dict[str, Any] | None = None,
        backoff_s: Callable[[int], float] = retry_backoff_s,
    ) -> None:
        self.max_inflight = max_inflight
        self.retries = retries
        self.engine_wait_s = engine_wait_s
        self.identity = identity or {}
        self.backoff_s = backoff_s
        self.inflight = 0
        self.tokens_total = 0
        self._engine = engine
        self._batches: set[Future[None]] = set()
        self._batches_lock = threading.Lock()
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="feeder", daemon=True)
        self._thread.start()
        self._client: ChatClient = self.call(self._make(client_factory))
        self._limiter: asyncio.Semaphore = self.call(self._semaphore(max_inflight))

    async def _make(self, factory: Callable[[], ChatClient]) -> ChatClient:
        return factory()

    async def _semaphore(self, size: int) -> asyncio.Semaphore:
        return asyncio.Semaphore(size)

    def call(self, coro: Awaitable[T], timeout_s: float | None = None) -> T:
        future: Future[T] = asyncio.run_coroutine_threadsafe(coro, self._loop)  # type: ignore[arg-type]
        return future.result(timeout_s)

    def submit(self, coro: Awaitable[T]) -> Future[T]:
        return asyncio.run_coroutine_threadsafe(coro, self._loop)  # type: ignore[arg-type]

    def run_batch(
        self,
        run: str,
        batch: str,
        records: Iterable[PromptRecord],
        params: GenerationParams,
        on_record: Callable[[int, CompletionRecord], None],
    ) -> Future[None]:
        """Start every prompt of a batch; `on_record(index, record)` fires as each finishes."""
        future = self.submit(self._batch(run, batch, list(records), params, on_record))
        with self._batches_lock:
            self._batches.add(future)
        future.add_done_callback(self._forget)
        return future

    def _forget(self, future: Future[None]) -> None:
        with self._batches_lock:
            self._batches.discard(future)

    def cancel_all(self) -> int:
        """Cancel every running batch (a shutdown that cannot wait): their requests stop, and
        each batch's thread checkpoints what finished and hands the batch back."""
        with self._batches_lock:
            running = list(self._batches)
        return sum(1 for future in running if future.cancel())

    async def _batch(
        self,
        run: str,
        batch: str,
        records: list[PromptRecord],
        params: GenerationParams,
        on_record: Callable[[int, CompletionRecord], None],
    ) -> None:
        async with asyncio.TaskGroup() as group:  # first hard failure cancels the rest
            for index, record in enumerate(records):
                group.create_task(self._one(run, batch, index, record, params, on_record))

    async def _one(
        self,
        run: str,
        batch: str,
        index: int,
        record: PromptRecord,
        params: GenerationParams,
        on_record: Callable[[int, CompletionRecord], None],
    ) -> None:
        attempt = 0
        while True:
            try:
                async with self._limiter:
                    self.inflight += 1
                    try:
                        result = await self._client.chat(record, params)
                    finally:
                        self.inflight -= 1
            except RequestRejected as exc:
                on_record(index, self._record(run, batch, record, exc))
                return
            except EngineDown as exc:
                attempt += 1
                if attempt > self.retries:
                    raise
                log.warning("%s/%s %s: %s; retry %d", run, batch, record.id, exc, attempt)
                await asyncio.sleep(self.backoff_s(attempt))
                await asyncio.to_thread(self._engine.wait_up, self.engine_wait_s)
                continue
            on_record(index, self._record(run, batch, record, result))
            return

    def _record(
        self,
        run: str,
        batch: str,
        record: PromptRecord,
        result: ChatResult | RequestRejected,
    ) -> CompletionRecord:
        if isinstance(result, RequestRejected):
            return CompletionRecord(
                id=record.id,
                run=run,
                batch=batch,
                messages=record.messages,
                reasoning=None,
                content=None,
                finish_reason=None,
                model=self._client.model,
                engine=self.identity,
                error={"type": result.kind, "message": str(result)},
                sample=record.sample,
                custom_id=record.custom_id,
            )
        self.tokens_total += result.usage.completion_tokens
        return CompletionRecord(
            id=record.id,
            run=run,
            batch=batch,
            messages=record.messages,
            reasoning=result.reasoning,
            content=result.content,
            finish_reason=result.finish_reason,
            usage=result.usage,
            model=result.model or self._client.model,
            engine=self.identity,
            latency_s=round(result.latency_s, 4),
            sample=record.sample,
            custom_id=record.custom_id,
            request_id=result.request_id,
        )

    def close(self) -> None:
        if not self._loop.is_running():
            return
        try:
            self.call(self._client.aclose(), timeout_s=5)
        except Exception:  # noqa: BLE001 - closing on shutdown must not raise
            pass
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=5)
        if not self._thread.is_alive():
            self._loop.close()  # else the garbage collector warns of an unclosed loop, anywhere
