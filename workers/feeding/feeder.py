"""Keeping the engine full: one asyncio loop and one in-flight limiter per worker.

Every batch the worker runs (Celery threads pool, several at once) submits its prompts here.
They all wait on one FIFO limiter sized a little above the cap the engine enforces,
so while one batch's stragglers finish, the next batch's prompts already fill the engine and
its own queue never runs dry. The loop runs on a thread of its own; batch threads block on a
concurrent future.

What each answer does to a prompt (the client maps HTTP to these errors):
- refused (400): an error record at once; the batch goes on.
- busy (429, queue full): backpressure. The prompt waits `Retry-After` (or a backoff) and is
  sent again, the limiter halves for a while; no try is spent. Only when one prompt has met
  nothing but backpressure for `busy_timeout_s` does its batch's try fail (retried later),
  never the prompt.
- failed try (abort, 5xx): sent again up to `retries` times, then an error record, provided
  the engine serves other prompts: one succeeded since this one began failing, or, when none
  did (nothing else left to run), a canary (the last prompt that succeeded, for one token)
  still succeeds. Otherwise the engine is what is broken and the batch's try fails instead.
- engine down: the prompt waits for the supervisor to bring it back and is retried; if it
  cannot come back, the batch fails and its finished prompts survive as a checkpoint.
- engine died with its answer begun (output streamed): the prompt was past its arrival, not
  the cause; it goes back at once when the engine is up again.
- engine died with it arriving (its request written, no output yet: whatever the exit code
  and however the socket closed): the prompt becomes a suspect and goes back through the
  `SuspectLane`, alone once it has been arriving at two of the engine's own deaths (no
  prompt, fresh or suspect, is sent from then until its output begins, and it waits for
  those in flight to begin theirs); a suspect at two of the engine's own deaths, the last as
  it arrived with no other prompt arriving beside it, is that prompt's error record once
  another prompt is served, never sent again (`feeding.blame`): one prompt that crashes the
  engine costs one record, not its batch or its worker's restart budget. The engine's own
  deaths with each prompt arriving are kept with the batch (`Evidence`), so a batch that
  moves to another worker takes them along. A kill (from outside, or the watchdog's for a
  stall) is no prompt's crash: what it cut goes back at once, nothing counted.
- past its deadline (`workers/feeding/deadline`: its max_tokens at the engine's measured pace): an
  error record at once, provided the engine serves other prompts; the batch goes on.
- engine refuses the worker (401/403/404): the batch stops; the task stops the worker
  consuming.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import logging
import threading
import time
from collections.abc import Awaitable, Callable, Iterable
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar

from genfleet.common.backoff import BUSY, PROMPT_RETRY
from genfleet.common.errors import (
    AnswerInterrupted,
    BatchTerminated,
    EngineBusy,
    EngineDown,
    EngineUnreachable,
    RequestFailed,
    RequestRejected,
    RequestTimedOut,
)
from genfleet.common.quality import QualityTally
from genfleet.common.records import CompletionRecord, GenerationParams, PromptRecord, Usage
from genfleet.common.waste import WasteTally
from genfleet.workers.feeding.blame import Death, Verdict, goes_alone, judge
from genfleet.workers.feeding.client import ChatResult
from genfleet.workers.feeding.deadline import DeadlinePolicy, SequencePace, max_tokens_of
from genfleet.workers.feeding.drawn import Drawn
from genfleet.workers.feeding.limiter import InflightLimiter
from genfleet.workers.feeding.suspects import SuspectLane

log = logging.getLogger("genfleet.feeder")
T = TypeVar("T")

# How long a suspect (not a solo) must be in the engine, the engine alive, to widen the lane
# as if it had survived its arrival, should its first output not have come sooner: a prompt
# that crashes the engine does so in its prefill or first steps (the emulator's and the
# crashes recorded of SGLang at once). Blame never rests on it: a prompt arrives until its
# first output, however long the engine queued it.
SUSPECT_PROBE_S = 2.0
# How long a prompt about to be blamed waits, out of the lane, for another prompt to be served
# (the proof that the engine serves others, not only that it dies), when none was since its
# first death here and no canary exists (a worker that has answered nothing yet).
SERVED_WAIT_S = 120.0
# The longest a failed request waits for its engine's exit to be counted: the supervisor sees
# an exit within half a second and reads the process's last log lines for up to two.
SETTLE_S = 4.0
DRAWN_READ_S = 5.0  # the longest a batch's thread waits for the loop to list them


class Evidence(Protocol):
    """Where the engine's own deaths with each prompt arriving are kept for the batch's next
    worker (`workers.crash_evidence.CrashEvidence`): `load` as a batch starts here (counts by
    `"sample:id"`), `add` at each such death. Called off the feeder's loop."""

    def load(self, run: str, batch: str) -> dict[str, int]: ...

    def add(self, run: str, batch: str, record: PromptRecord) -> None: ...


class EngineHandle(Protocol):
    """The supervisor (or an external engine) as the feeder sees it: wait for it to be up;
    `deaths` counts the exits a prompt in flight may have caused, `crashes` those of them
    the engine made itself with an error (the only ones a prompt is blamed for: not a kill
    from outside, not the watchdog's), `last_error` the latest, `alive()` whether its
    process runs (True when it cannot tell)."""

    @property
    def state(self) -> str: ...

    @property
    def deaths(self) -> int: ...

    @property
    def crashes(self) -> int: ...

    @property
    def last_error(self) -> str | None: ...

    def alive(self) -> bool: ...

    def wait_up(self, timeout_s: float) -> None: ...

    def forgive(self, restarts: int) -> None:
        """A prompt was blamed for deaths that cost this many restarts: they no longer count
        against the restart budget (the engine serves other prompts)."""
        ...


class ChatClient(Protocol):
    """What the feeder sends prompts through: `EngineClient`, or a fake in the unit tests."""

    model: str

    async def chat(
        self,
        record: PromptRecord,
        params: GenerationParams,
        timeout_s: float | None = None,
        on_begun: Callable[[], None] | None = None,
        on_tokens: Callable[[int], None] | None = None,
        drawn: Drawn | None = None,
    ) -> ChatResult:
        """`on_begun()` fires at the answer's first output text (none may come); `on_tokens(n)`
        as its tokens stream (n < 0 corrects an estimate); a client that does not stream
        need not call it. `drawn`: the answer so far, drawn by ids and gone on from (from
        `drawing`); None: a chat request, from the answer's beginning."""
        ...

    def drawing(self, record: PromptRecord, params: GenerationParams) -> Drawn | str:
        """A new answer's `Drawn` when this client can draw it by ids and continue it after a
        cut, else why not (the answer then starts over, and its record says why)."""
        ...

    def refusal(self, record: PromptRecord, params: GenerationParams) -> str | None:
        """Why this answer cannot be drawn by ids now (None: it can), `drawing`'s reason,
        asked again before each try: an engine may be found since to render no prompt."""
        ...

    async def aclose(self) -> None: ...


def retry_backoff_s(attempt: int) -> float:
    """Seconds before the `attempt`-th retry of a prompt whose engine went down or whose try
    failed (abort, 5xx): common.backoff's PROMPT_RETRY."""
    return PROMPT_RETRY.delay_s(attempt)


def default_max_inflight(max_running_requests: int | None) -> int:
    """A little above the engine's cap so its queue never runs dry between completions."""
    if not max_running_requests:
        return 64
    return int(max_running_requests * 1.25) + 4


def busy_delay_s(retry_after_s: float | None, refusals: int) -> float:
    """How long a prompt the engine called busy waits: its Retry-After, else a backoff."""
    if retry_after_s is not None:
        return max(retry_after_s, 0.05)
    return BUSY.delay_s(refusals)


class Arrival(enum.Enum):
    """Where a prompt's last send stands against its arrival in the engine."""

    UNSENT = "unsent"  # never held a limiter slot: counted in Feeder.waiting
    READY = "ready"  # holds (or held) a slot; this send is not in the engine yet
    ARRIVING = "arriving"  # in the engine with no output yet: counted in Feeder._arriving
    BEGUN = "begun"  # its answer began (output streamed): past its arrival
    ENDED = "ended"  # it ended (or failed) with no output


class Lane(enum.Enum):
    """What a suspect holds of the `SuspectLane` (kept past a failed send until `_down` has
    seen the engine back)."""

    OUT = "out"
    SHARED = "shared"  # one of the lane's slots
    SOLO = "solo"  # the lane alone, fresh prompts held back, until it survives its arrival


@dataclass
class _Tries:
    """One prompt's tries so far (see `Feeder._one`)."""

    attempt: int = 0  # failed tries: engine down, abort, 5xx
    refusals: int = 0  # backpressure answers in a row
    busy_since: float | None = None
    failing_since: float | None = None
    arrival: Arrival = Arrival.UNSENT  # of its last send
    lane: Lane = Lane.OUT
    sent_at: float = 0.0
    send_no: int = 0  # its last send's number (`Feeder._sends`)
    deaths_at_send: int = 0
    crashes_at_send: int = 0
    # the engine's own deaths (`EngineHandle.crashes`) with it arriving, here and on the
    # workers that ran its batch before (`Evidence`)
    crashes: int = 0
    crashes_here: int = 0  # of those, this worker's: the restarts forgiven at its blame
    first_death_s: float | None = None
    # Facts of its last send, each read on its own: another prompt was arriving during its
    # arrival; it outlived its arrival (`Feeder._probe`); it failed arriving with no other
    # suspect in the engine (read by `_down`, set when it fails).
    overlapped: bool = False
    survived: bool = False
    alone: bool = False
    spent: int = 0  # tokens the engine generated in tries that failed (an abort's)
    # The answer drawn by ids so far, gone on from after a cut (None: drawn by the chat
    # endpoint, or not started); else why it starts over, and the tokens that cost.
    drawn: Drawn | None = None
    restart_reason: str | None = None
    restarted_tokens: int = 0


class _Streamed:
    """One try's tokens as they stream, added to the feeder's `streamed_tokens_total`; at
    the answer's end the total is set right to its exact count (`settle`)."""

    __slots__ = ("feeder", "tokens")

    def __init__(self, feeder: Feeder) -> None:
        self.feeder = feeder
        self.tokens = 0

    def add(self, n: int) -> None:
        self.tokens += n
        self.feeder.streamed_tokens_total += n

    def settle(self, completion_tokens: int) -> None:
        self.add(completion_tokens - self.tokens)


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
        busy_timeout_s: float = 1800.0,
        identity: dict[str, Any] | None = None,
        backoff_s: Callable[[int], float] = retry_backoff_s,
        deadline: DeadlinePolicy | None = None,
        on_batch_sent: Callable[[str, str], None] | None = None,
        on_answer_left: Callable[[], None] | None = None,
        on_batch_arrived: Callable[[int], None] | None = None,
        evidence: Evidence | None = None,
        exit_grace_s: float = 0.0,
    ) -> None:
        """`on_batch_sent(run, batch)` fires (on the feeder's loop) once every prompt of a
        batch is in the engine: the worker hands that batch's slot to the next one.
        `on_answer_left()` fires (on the loop) each time prompts leave the worker (`held`): a
        prompt's record made, or a batch cancelled with prompts unanswered. The room they
        left may take a batch whose slot waits for it.
        `on_batch_arrived(prompts)` fires (on the loop) as a batch's prompts are counted in
        `waiting`: the worker's count of what it holds is whole again.
        `evidence`: where prompts' engine deaths are kept for the batch's next worker.
        `exit_grace_s`: how long a written request that failed waits for the engine's exit
        to be counted while its process still runs (an engine that closes its connections
        before it exits); 0 for an engine whose exits nobody watches (external)."""
        self.max_inflight = max_inflight
        self.deadline = deadline  # None: the client's own timeout for every request
        self.pace = SequencePace()  # per-sequence tok/s of recent completions
        self.timeouts_total = 0  # requests that outlived their deadline
        self.crashes_total = 0  # prompts given an error record for crashing the engine
        self.retries = retries
        self.engine_wait_s = engine_wait_s
        self.busy_timeout_s = busy_timeout_s
        self.identity = identity or {}
        self.backoff_s = backoff_s
        self.on_batch_sent = on_batch_sent
        self.on_answer_left = on_answer_left
        self.on_batch_arrived = on_batch_arrived
        self.evidence = evidence
        self.exit_grace_s = exit_grace_s
        self.inflight = 0
        # Prompts whose request failed with the engine down and whose part in the death is
        # not judged and kept yet (`_counted`): a batch handed back before then would take
        # the engine's deaths away from its prompts' evidence.
        self.judging = 0
        self.waiting = 0  # prompts submitted that do not hold a limiter slot yet
        # prompts of the batches here with no record yet: sent, waiting, or between two tries
        # (an engine restarting): what the worker holds against its engine's room
        self.held = 0
        self.tokens_total = 0  # completion tokens of finished answers
        # Tokens as they stream, answers in flight included: each answer's exact count once it
        # ends, what it streamed when it fails (those were generated). The rate of a window
        # shorter than the answers reads from this, not from `tokens_total`.
        self.streamed_tokens_total = 0
        self.busy_total = 0  # answers that were backpressure (429, queue full)
        self.failed_tries_total = 0  # aborts, 5xx: tries sent again
        self.waste = WasteTally()  # where this worker's tokens went (common/waste.py)
        self.quality = QualityTally()  # what its answers are worth (common/quality.py)
        self.last_success_s = -float("inf")  # monotonic time of the last completion
        self._canary: tuple[PromptRecord, GenerationParams] | None = None  # last success
        self._engine = engine
        self._batches: set[Future[None]] = set()
        self._by_batch: dict[tuple[str, str], Future[None]] = {}
        # Batches an operator terminated, and the loop task of each running batch: the task is
        # cancelled and the batch's future ends in BatchTerminated, not a plain cancellation.
        self._terminating: set[tuple[str, str]] = set()
        self._tasks: dict[tuple[str, str], asyncio.Task[None]] = {}
        self._batches_lock = threading.Lock()
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="feeder", daemon=True)
        self._thread.start()
        self._client: ChatClient = self.call(self._make(client_factory))
        self._limiter = InflightLimiter(max_inflight)
        self._lane = SuspectLane()
        self._sends = 0  # requests sent so far (numbers them)
        self._arriving = 0  # requests in flight with no output yet
        self._none_arriving = asyncio.Event()  # set each time `_arriving` falls to 0
        self._live = 0  # prompts submitted and not yet done with (a record, or cancelled)
        self._unblamed = 0  # of those, prompts waiting to be blamed (`_served_since`)
        # set at each success, each prompt done with and each prompt that starts waiting to
        # be blamed: what `_served_since` waits on
        self._changed = asyncio.Event()
        # Each running batch's prompts not yet done with, by (id, sample): what a checkpoint
        # keeps of the answers in flight (`read_live`).
        self._live_answers: dict[tuple[str, str], dict[tuple[str, int], _Tries]] = {}

    async def _make(self, factory: Callable[[], ChatClient]) -> ChatClient:
        return factory()

    @property
    def settled(self) -> bool:
        """No prompt is in the engine or being judged for its death: every answer a dead
        engine cut waits for it to be back, its ids and the death's count kept (read from a
        batch's thread: two counters the loop writes, read without its lock)."""
        return self.inflight == 0 and self.judging == 0

    @property
    def inflight_cap(self) -> int:
        """The limiter's size now: `max_inflight`, less while the engine pushes back."""
        return self._limiter.size

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
        on_sent: Callable[[], None] | None = None,
        drawn: dict[tuple[str, int], Drawn] | None = None,
    ) -> Future[None]:
        """Start every prompt of a batch; `on_record(index, record)` fires as each finishes,
        `on_sent()` once every prompt has been sent to the engine (only stragglers left).
        `drawn`: answers an earlier try of the batch had begun (its checkpoint), by (id,
        sample): they go on from their ids."""
        carried = self._carried(run, batch)
        future = self.submit(
            self._batch(run, batch, list(records), params, on_record, on_sent, carried, drawn)
        )
        with self._batches_lock:
            self._batches.add(future)
            self._by_batch[(run, batch)] = future
        future.add_done_callback(self._forget)
        return future

    def _carried(self, run: str, batch: str) -> dict[str, int]:
        """The engine's own deaths each of the batch's prompts was arriving at on the workers
        that ran it before (read on the caller's thread, before the batch starts)."""
        return self.evidence.load(run, batch) if self.evidence is not None else {}

    def _forget(self, future: Future[None]) -> None:
        with self._batches_lock:
            self._batches.discard(future)
            for name, running in list(self._by_batch.items()):
                if running is future:
                    del self._by_batch[name]
                    # Here, not when the coroutine ends: `cancel_batch` may still see the
                    # batch until now, and must not leave a mark for its next delivery.
                    self._terminating.discard(name)

    def cancel_batch(self, run: str, batch: str) -> bool:
        """Stop one running batch because an operator terminated its task: its requests are
        cancelled and its future raises BatchTerminated (so the task parks it in the failed
        set instead of handing it back to the queue). False when it does not run here."""
        with self._batches_lock:
            future = self._by_batch.get((run, batch))
            if future is None or future.done():
                return False
            self._terminating.add((run, batch))
            task = self._tasks.get((run, batch))
        if task is not None:  # else `_batch` has not started and stops as it starts
            self._loop.call_soon_threadsafe(task.cancel)
        return True

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
        on_sent: Callable[[], None] | None = None,
        carried: dict[str, int] | None = None,
        drawn: dict[tuple[str, int], Drawn] | None = None,
    ) -> None:
        name = (run, batch)
        with self._batches_lock:
            task = asyncio.current_task()
            if task is not None:
                self._tasks[name] = task
            terminated = name in self._terminating
        unsent = [len(records)]  # this batch's share of self.waiting
        self.waiting += len(records)
        held = [len(records)]  # this batch's share of self.held
        self.held += len(records)
        self._hook(self.on_batch_arrived, len(records))

        def recorded(index: int, record: CompletionRecord) -> None:
            held[0] -= 1
            self.held -= 1
            on_record(index, record)
            self._hook(self.on_answer_left)

        def sent() -> None:
            if on_sent is not None:
                on_sent()
            if self.on_batch_sent is not None:
                self.on_batch_sent(run, batch)

        try:
            if terminated:
                raise asyncio.CancelledError
            if not records:
                sent()
            async with asyncio.TaskGroup() as group:  # first hard failure cancels the rest
                live = self._live_answers.setdefault(name, {})
                for index, record in enumerate(records):
                    tries = _Tries(crashes=(carried or {}).get(f"{record.sample}:{record.id}", 0))
                    tries.drawn = (drawn or {}).get((record.id, record.sample))
                    live[(record.id, record.sample)] = tries
                    group.create_task(
                        self._one(
                            run, batch, index, record, params, recorded, (unsent, sent), tries
                        )
                    )
        except asyncio.CancelledError:
            with self._batches_lock:
                terminated = name in self._terminating
            if terminated:
                raise BatchTerminated(f"{run}/{batch} terminated by an operator") from None
            raise
        finally:
            self.waiting -= unsent[0]  # prompts cancelled before they were ever sent
            if held[0]:
                self.held -= held[0]  # and those cancelled with no record
                self._hook(self.on_answer_left)
            self._live_answers.pop(name, None)
            with self._batches_lock:
                if self._tasks.get(name) is task:
                    del self._tasks[name]

    async def _one(
        self,
        run: str,
        batch: str,
        index: int,
        record: PromptRecord,
        params: GenerationParams,
        on_record: Callable[[int, CompletionRecord], None],
        progress: tuple[list[int], Callable[[], None]],
        tries: _Tries,
    ) -> None:
        self._live += 1
        try:
            await self._tries(run, batch, index, record, params, on_record, progress, tries)
        finally:
            self._live -= 1
            self._changed.set()
            self._live_answers.get((run, batch), {}).pop((record.id, record.sample), None)

    async def _tries(
        self,
        run: str,
        batch: str,
        index: int,
        record: PromptRecord,
        params: GenerationParams,
        on_record: Callable[[int, CompletionRecord], None],
        progress: tuple[list[int], Callable[[], None]],
        tries: _Tries,
    ) -> None:
        if tries.drawn is None:
            way = self._client.drawing(record, params)
            if isinstance(way, Drawn):
                tries.drawn = way
            else:
                tries.restart_reason = way
        while True:
            try:
                result = await self._send(record, params, tries, progress)
            except RequestRejected as exc:
                on_record(index, self._record(run, batch, record, exc, tries.spent, tries))
                return
            except RequestTimedOut as exc:
                late = await self._late(exc, tries)
                on_record(index, self._record(run, batch, record, late, tries.spent, tries))
                return
            except EngineBusy as exc:
                await self._busy(exc, tries)
                continue
            except RequestFailed as exc:
                if tries.drawn is None:  # else its tokens stay with the answer
                    tries.spent += exc.tokens
                elif self._recheck_drawing(record, params, tries):
                    continue  # the way failed, not the answer: no try counted against it
                if await self._failed(run, batch, record, exc, tries):
                    on_record(index, self._record(run, batch, record, exc, tries.spent, tries))
                    return
                continue
            except EngineDown as exc:
                crash = await self._down(run, batch, record, exc, tries)
                if crash is not None:
                    on_record(index, self._record(run, batch, record, crash, tries.spent, tries))
                    return
                continue
            now = time.monotonic()
            self.last_success_s = now
            self._changed.set()
            self.pace.add(result.usage.completion_tokens, result.latency_s)
            self._canary = (record, params)
            self._limiter.completed(now)
            on_record(index, self._record(run, batch, record, result, tries=tries))
            return

    def _hook(self, hook: Callable[..., None] | None, *args: int) -> None:
        """Tell the worker what its slots count on; a failing hook fails no request."""
        if hook is not None:
            try:
                hook(*args)
            except Exception:  # noqa: BLE001 - the answers are the worker's, whatever it does
                log.exception("the worker's slot hook failed")

    async def _send(
        self,
        record: PromptRecord,
        params: GenerationParams,
        tries: _Tries,
        progress: tuple[list[int], Callable[[], None]],
    ) -> ChatResult:
        """One try: through the suspect lane when the engine died with it in flight, then a
        limiter slot, then the engine, with this request's own deadline."""
        unsent, on_sent = progress
        self._recheck_drawing(record, params, tries)
        before = len(tries.drawn.ids) if tries.drawn is not None else 0
        timeout_s = self._deadline_s(record, params, before)
        suspect = tries.crashes > 0
        if suspect:
            solo = goes_alone(tries.crashes)
            rank = (-float(tries.crashes), -tries.sent_at)
            await self._lane.enter(rank, solo=solo)
            tries.lane = Lane.SOLO if solo else Lane.SHARED
        ok = False
        try:
            await self._slot(suspect)
            try:
                if tries.arrival is Arrival.UNSENT:
                    tries.arrival = Arrival.READY
                    self.waiting -= 1
                    unsent[0] -= 1
                    if unsent[0] == 0:
                        on_sent()
                if tries.lane is Lane.SOLO:
                    await self._quiet()
                if not self._engine.alive():  # dead, its exit not seen yet: never sent
                    raise EngineUnreachable("the engine process is not running")
                self.inflight += 1
                tries.sent_at = time.monotonic()
                tries.deaths_at_send = self._engine.deaths
                tries.crashes_at_send = self._engine.crashes
                tries.survived = tries.alone = False
                self._arrive(tries)
                probe = self._probe(tries) if suspect else None
                streamed = _Streamed(self)
                try:
                    result = await self._client.chat(
                        record,
                        params,
                        timeout_s,
                        lambda: self._arrived(tries, True, suspect),
                        on_tokens=streamed.add,
                        drawn=tries.drawn,
                    )
                    streamed.settle(result.usage.completion_tokens - before)
                except BaseException:
                    if tries.drawn is None:  # an answer drawn by chat starts over
                        tries.restarted_tokens += max(streamed.tokens, 0)
                    raise
                finally:
                    self.inflight -= 1
                    self._arrived(tries, False, suspect)
                    if probe is not None:
                        probe.cancel()
            finally:
                self._limiter.release()
            ok = True
            return result
        except EngineDown as exc:
            if suspect and not isinstance(exc, RequestTimedOut):
                # Alone if no other suspect is in the engine as it fails: the others in flight
                # at the same death still hold their slots (they leave in `_down`, once the
                # engine is back), one that entered alone but was joined later does not count
                # as alone. And the engine may be dying: no other suspect goes until `_down`
                # has seen it back (else one sent into the dying engine would look as if it had
                # been in flight at the death).
                # And only while it was arriving (no output yet), with no other prompt
                # arriving at any moment of its arrival: a prompt that kills the engine does
                # so as it arrives, so a death after its first output, or beside another
                # arrival (a fresh poison sent at the same moment), may not be its own.
                tries.alone = (
                    self._lane.held == 1
                    and tries.arrival is not Arrival.BEGUN
                    and not tries.overlapped
                )
                suspect = False  # it keeps its lane slot until `_down`
            raise
        finally:
            if suspect:
                self._lane.leave(ok, tries.lane is Lane.SOLO)
                tries.lane = Lane.OUT

    def _recheck_drawing(
        self, record: PromptRecord, params: GenerationParams, tries: _Tries
    ) -> bool:
        """An answer to be drawn by ids whose prompt is not rendered yet: the client may have
        found since that it cannot draw by ids after all (its engine renders no prompt). The
        answer then goes through the chat endpoint: it starts over (from the ids a checkpoint
        carried in, too) and says why. True when it does so now."""
        if tries.drawn is None or tries.drawn.prompt_ids is not None:
            return False
        why = self._client.refusal(record, params)
        if why is None:
            return False
        tries.restarted_tokens += len(tries.drawn.ids)
        tries.drawn, tries.restart_reason = None, why
        return True

    async def _slot(self, suspect: bool) -> None:
        """A limiter slot. A fresh prompt waits while a solo suspect holds the lane (`calm`
        clear) before it takes one, and after too: the solo may have entered meanwhile. A
        suspect's lane turn already keeps it out of a solo's way. No slot is held while
        waiting for calm: the solo needs one."""
        while True:
            if not suspect:
                await self._lane.calm.wait()
            await self._limiter.acquire()
            if suspect or self._lane.calm.is_set():
                return
            self._limiter.release()

    async def _quiet(self) -> None:
        """A solo suspect waits for every prompt in flight to be past its arrival (output
        streamed, or ended), so that nothing arrives beside it; fresh prompts wait for calm
        meanwhile, so this ends as soon as the ones sent before have begun."""
        while self._arriving:
            self._none_arriving.clear()
            await self._none_arriving.wait()

    def _arrive(self, tries: _Tries) -> None:
        """A send: numbered, counted as arriving until its first output or its end."""
        self._sends += 1
        tries.send_no = self._sends
        tries.overlapped = self._arriving > 0
        tries.arrival = Arrival.ARRIVING
        self._arriving += 1

    def _arrived(self, tries: _Tries, begun: bool, suspect: bool) -> None:
        """A send's arrival ended: its first output (`begun`; a suspect then survived, as
        `_probe` would say later), or its end with none. Sends after its own overlapped it."""
        if tries.arrival is not Arrival.ARRIVING:
            return
        tries.arrival = Arrival.BEGUN if begun else Arrival.ENDED
        tries.overlapped = tries.overlapped or self._sends != tries.send_no
        self._arriving -= 1
        if not self._arriving:
            self._none_arriving.set()
        if begun and suspect and self._engine.deaths == tries.deaths_at_send:
            self._survive(tries)

    def _survive(self, tries: _Tries) -> None:
        if tries.survived:
            return
        tries.survived = True
        self._lane.survived(tries.lane is Lane.SOLO)
        if tries.lane is Lane.SOLO:
            tries.lane = Lane.SHARED  # its slot stays held until it ends

    def _probe(self, tries: _Tries) -> asyncio.TimerHandle:
        """A suspect was sent: if it is still in flight `SUSPECT_PROBE_S` later and the engine
        has not died meanwhile, it survived its arrival (`SuspectLane.survived`): the lane
        widens. Not a solo's: it holds the lane, and fresh prompts, until its first output,
        which a full engine may queue past this."""
        deaths = tries.deaths_at_send

        def passed() -> None:
            if tries.lane is Lane.SOLO:
                return
            if self._engine.deaths == deaths and self._engine.alive():
                self._survive(tries)

        return asyncio.get_running_loop().call_later(SUSPECT_PROBE_S, passed)

    async def _late(self, exc: RequestTimedOut, tries: _Tries) -> RequestFailed:
        """Past its deadline: the prompt's error record, if the engine serves others."""
        self.timeouts_total += 1
        if await self._serves_others(tries.sent_at):
            return RequestFailed(0, "timeout", f"no answer within its deadline: {exc}")
        raise EngineDown(
            f"a request outlived its deadline ({exc}) and the engine serves no other prompt either"
        ) from exc

    async def _busy(self, exc: EngineBusy, tries: _Tries) -> None:
        """Backpressure: wait and send again; only a long spell of it fails the batch's try."""
        now = time.monotonic()
        tries.busy_since = now if tries.busy_since is None else tries.busy_since
        if now - tries.busy_since > self.busy_timeout_s:
            raise EngineDown(
                f"the engine answered busy for {now - tries.busy_since:.0f} s "
                f"(busy_timeout_s): {exc}"
            ) from exc
        self.busy_total += 1
        tries.refusals += 1
        self._limiter.shrink(now)
        await asyncio.sleep(busy_delay_s(exc.retry_after_s, tries.refusals))

    async def _failed(
        self, run: str, batch: str, record: PromptRecord, exc: RequestFailed, tries: _Tries
    ) -> bool:
        """A failed try (abort, 5xx): True when the prompt is done trying (an error record)."""
        tries.busy_since, tries.refusals = None, 0
        now = time.monotonic()
        tries.failing_since = now if tries.failing_since is None else tries.failing_since
        tries.attempt += 1
        self.failed_tries_total += 1
        if tries.attempt > self.retries:
            # Judged as a death is: a worker that has answered nothing yet (no canary) waits
            # for another prompt to be served, or for every other one to fail too.
            if await self._served_since(tries.failing_since):
                return True
            raise EngineDown(
                f"{record.id} failed {tries.attempt} times ({exc}) and the engine serves no "
                "other prompt either"
            ) from exc
        log.warning("%s/%s %s: %s; try %d", run, batch, record.id, exc, tries.attempt)
        await asyncio.sleep(self.backoff_s(tries.attempt))
        return False

    async def _down(
        self, run: str, batch: str, record: PromptRecord, exc: EngineDown, tries: _Tries
    ) -> RequestFailed | None:
        """The engine went down: wait until it is back, judge what its death means for the
        prompt (`feeding.blame`), and blame it (its error record) when that says so and the
        engine serves other prompts."""
        try:
            verdict = await self._counted(run, batch, record, exc, tries)
        finally:
            if tries.lane is not Lane.OUT:
                self._lane.leave(ok=False, exclusive=tries.lane is Lane.SOLO)
                tries.lane = Lane.OUT
        if verdict is not Verdict.BLAME:
            return None
        assert tries.first_death_s is not None  # set as the death was counted
        if not await self._served_since(tries.first_death_s):
            log.warning(
                "%s/%s %s: the engine died with it arriving alone, but no other prompt was "
                "served since: sent again, not blamed",
                run,
                batch,
                record.id,
            )
            return None
        self.crashes_total += 1
        self._engine.forgive(tries.crashes_here)
        log.error(
            "%s/%s %s: the engine died %d times with it arriving: an error record, not sent again",
            run,
            batch,
            record.id,
            tries.crashes,
        )
        return RequestFailed(
            0,
            "engine_crash",
            f"the engine died {tries.crashes} times with this prompt arriving, the last time "
            f"as the only prompt arriving ({self._engine.last_error}); not sent again",
        )

    async def _counted(
        self, run: str, batch: str, record: PromptRecord, exc: EngineDown, tries: _Tries
    ) -> Verdict:
        """Count the engine's death against the prompt as `feeding.blame.judge` says (the
        lane slot, if any, still held), then wait for the engine to be back. The death is
        counted, and an own one kept with the batch's evidence, as soon as the supervisor
        has seen the exit, before the restart: a worker lost while its engine restarts
        leaves it for the batch's next worker."""
        tries.busy_since, tries.refusals = None, 0
        tries.attempt += 1
        if tries.attempt > self.retries:
            raise exc
        log.warning("%s/%s %s: %s; retry %d", run, batch, record.id, exc, tries.attempt)
        self.judging += 1
        try:
            await asyncio.sleep(self.backoff_s(tries.attempt))
            reached = not isinstance(exc, EngineUnreachable)  # else never in flight
            await self._settle(tries.deaths_at_send, reached)
            verdict = await self._count(run, batch, record, exc, tries, reached)
        finally:
            self.judging -= 1
        await asyncio.to_thread(self._engine.wait_up, self.engine_wait_s)
        if verdict is Verdict.NOT_IN_IT:  # an exit the supervisor saw only later
            verdict = await self._count(run, batch, record, exc, tries, reached)
        return verdict

    async def _count(
        self,
        run: str,
        batch: str,
        record: PromptRecord,
        exc: EngineDown,
        tries: _Tries,
        reached: bool,
    ) -> Verdict:
        """Judge the death the engine's counts show now, and count it against the prompt."""
        death = Death(
            reached=reached,
            died=self._engine.deaths > tries.deaths_at_send,
            begun=isinstance(exc, AnswerInterrupted),
            own=self._engine.crashes > tries.crashes_at_send,
            alone=tries.alone,
        )
        verdict = judge(death, tries.crashes)
        if verdict is Verdict.NOT_IN_IT:
            return verdict
        self._lane.died()
        if verdict is Verdict.PAST_ARRIVAL:
            # Its answer had begun: past its arrival, so not the cause of this death, nor
            # of any before (it would have killed the engine arriving again). It goes
            # back at once, not through the lane: after a restart most of what was in
            # flight does, and the engine is full again at once, not a few at a time.
            tries.crashes = tries.crashes_here = 0
            tries.first_death_s = None
            return verdict
        if verdict is Verdict.KILLED:
            # No prompt's doing: back as it was before (a suspect still goes through the
            # lane for its own deaths before), the engine full again at once.
            return verdict
        if tries.first_death_s is None:
            tries.first_death_s = time.monotonic()
        tries.crashes += 1
        tries.crashes_here += 1
        if self.evidence is not None:
            await asyncio.to_thread(self.evidence.add, run, batch, record)
        return verdict

    async def _settle(self, deaths: int, reached: bool) -> None:
        """A connection failed: give the supervisor a moment to count the engine's exit
        (it reads the dying process's last log lines first), so that the death is judged
        before the prompt is sent again. A written request waits up to `exit_grace_s` even
        while the process still runs and reads ready: an engine may close its connections a
        moment before it exits. A request that never connected waits only while the process
        is gone."""
        engine = self._engine
        started = time.monotonic()
        while engine.deaths == deaths and engine.state in ("ready", "restarting"):
            waited_s = time.monotonic() - started
            if engine.state == "ready" and engine.alive():
                if not reached or waited_s >= self.exit_grace_s:
                    return
            if waited_s >= max(self.exit_grace_s, SETTLE_S):
                return
            await asyncio.sleep(0.1)

    async def _served_since(self, since: float) -> bool:
        """Whether the engine serves prompts other than one about to be blamed, which first
        died with it (or failed every try on it) at `since`: one succeeded since, or the
        canary does; with neither (a worker that has answered nothing yet: an abort in the
        first answers of a run), while other prompts are still to run here,
        wait up to SERVED_WAIT_S for one of them to succeed (the suspect is out of the lane
        meanwhile, so they go). False when nothing else is left to run (every other prompt
        here is done or waits to be blamed too) or none succeeds."""
        deadline = time.monotonic() + SERVED_WAIT_S
        self._unblamed += 1
        self._changed.set()
        try:
            while True:
                if await self._serves_others(since):
                    return True
                left_s = deadline - time.monotonic()
                # nothing left that could be served: every other prompt here waits as well
                if self._live <= self._unblamed or left_s <= 0:
                    return False
                self._changed.clear()
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(left_s):
                        await self._changed.wait()
        finally:
            self._unblamed -= 1

    def _deadline_s(
        self, record: PromptRecord, params: GenerationParams, drawn_tokens: int = 0
    ) -> float | None:
        """This request's deadline: the token budget it has left (less what an answer gone on
        from had drawn) at the engine's measured pace."""
        if self.deadline is None:
            return None
        budget = max(max_tokens_of(record.params, params.max_tokens) - drawn_tokens, 1)
        return self.deadline.deadline_s(budget, self.pace.tokens_per_s())

    async def _serves_others(self, failing_since: float) -> bool:
        """Whether the engine serves prompts other than one that failed every try.

        Yes when another prompt succeeded since that one began failing; when none did (maybe
        nothing else was left to run), the last prompt that ever succeeded is sent again for
        one token and must succeed. An engine that never answered anything serves nobody.
        """
        if self.last_success_s > failing_since:
            return True
        if self._canary is None:
            return False
        record, params = self._canary
        canary = PromptRecord(
            record.id, record.messages, params={**(record.params or {}), "max_tokens": 1}
        )
        try:
            async with self._limiter:
                await self._client.chat(canary, params)
        except (EngineBusy, EngineDown, RequestFailed, RequestRejected):
            return False
        self.last_success_s = time.monotonic()
        return True

    def _record(
        self,
        run: str,
        batch: str,
        record: PromptRecord,
        result: ChatResult | RequestRejected | RequestFailed,
        spent_tokens: int = 0,
        tries: _Tries | None = None,
    ) -> CompletionRecord:
        """The prompt's output record; an error record's usage counts the tokens its failed
        tries generated (`spent_tokens`, and an answer drawn by ids: GPU time that bought
        nothing). A completion says how many of its tokens it went on from after a cut
        (`resumed_tokens`), and an answer that had to start over, why and what that cost
        (`restarted`)."""
        restarted = None
        if tries is not None and tries.restarted_tokens:
            restarted = {"tokens": tries.restarted_tokens, "reason": tries.restart_reason}
        if isinstance(result, RequestRejected | RequestFailed):
            if tries is not None and tries.drawn is not None:
                spent_tokens += len(tries.drawn.ids)
            self.waste.add({"error": True, "usage": {"completion_tokens": spent_tokens}})
            self.quality.add({"error": True})
            return CompletionRecord(
                id=record.id,
                run=run,
                batch=batch,
                messages=record.messages,
                reasoning=None,
                content=None,
                finish_reason=None,
                usage=Usage(completion_tokens=spent_tokens),
                model=self._client.model,
                engine=self.identity,
                error={"type": result.kind, "message": str(result)},
                sample=record.sample,
                custom_id=record.custom_id,
                restarted=restarted,
            )
        self.tokens_total += result.usage.completion_tokens
        answer = {
            "finish_reason": result.finish_reason,
            "content": result.content,
            "reasoning": result.reasoning,
            "usage": {
                "completion_tokens": result.usage.completion_tokens,
                "reasoning_tokens": result.usage.reasoning_tokens,
            },
            "repetition": result.repetition,
        }
        self.waste.add(answer)
        self.quality.add(answer)
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
            logprobs=result.logprobs,
            repetition=result.repetition,
            resumed_tokens=result.resumed_tokens,
            restarted=restarted,
        )

    def read_live(
        self, run: str, batch: str, read: Callable[[dict[tuple[str, int], Drawn]], T]
    ) -> T:
        """`read(answers)` on the feeder's loop, where they are written: the batch's answers
        in flight drawn by ids and not ended, by (id, sample). What its checkpoint copies and
        its journal writes (workers/batch). Raises RuntimeError or TimeoutError when the loop
        is gone or stuck."""
        return self.call(self._read_live(run, batch, read), timeout_s=DRAWN_READ_S)

    def movable(self, run: str, batch: str) -> bool:
        """Whether the batch's next try, on any worker, would know all this one knows of its
        answers: none started over with tokens thrown away or spent tokens in failed tries
        (counts its records carry that only this try holds). Raises as `read_live`."""
        return self.call(self._movable(run, batch), timeout_s=DRAWN_READ_S)

    async def _movable(self, run: str, batch: str) -> bool:
        answers = self._live_answers.get((run, batch), {}).values()
        return not any(tries.restarted_tokens or tries.spent for tries in answers)

    async def _read_live(
        self, run: str, batch: str, read: Callable[[dict[tuple[str, int], Drawn]], T]
    ) -> T:
        live = {
            key: tries.drawn
            for key, tries in self._live_answers.get((run, batch), {}).items()
            if tries.drawn is not None and not tries.drawn.ended
        }
        return read(live)

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
