"""The engine as the feeder sees it, in memory: a chat client and a supervisor handle.

`FakeChat` answers each prompt after an optional gate opens, or raises what the test scripted
for that prompt's attempts; it counts calls, requests in flight (and the most at once) and
requests cancelled mid-flight. `FakeEngine` stands in for the supervisor's `wait_up`.
`CrashingEngine` is both, an engine that prompts crash or a test kills.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections import Counter
from collections.abc import Callable

from genfleet.common.errors import AnswerInterrupted, EngineDown
from genfleet.common.records import GenerationParams, PromptRecord, Usage
from genfleet.workers.feeding.client import NO_TOKEN_IDS, ChatResult
from genfleet.workers.feeding.drawn import Drawn
from genfleet.workers.feeding.feeder import ChatClient, EngineHandle

GATE_DEADLINE_S = 30.0


def answer(record: PromptRecord, tokens: int = 7) -> ChatResult:
    """The completion FakeChat returns for `record`: derived from the prompt, so checkable."""
    return ChatResult(
        content=f"answer to {record.id}#{record.sample}",
        reasoning=None,
        finish_reason="stop",
        usage=Usage(prompt_tokens=3, completion_tokens=tokens, reasoning_tokens=0),
        latency_s=0.001,
        request_id=f"req-{record.id}",
        model="fake-model",
    )


class FakeChat:
    """A chat client whose answers, failures and timing the test decides."""

    def __init__(
        self,
        *,
        failures: dict[str, list[BaseException]] | None = None,
        gate: threading.Event | None = None,
        ungated: set[str] | None = None,
        tokens: int = 7,
        delay_s: float | Callable[[PromptRecord], float] = 0.0,
    ) -> None:
        self.model = "fake-model"
        self.delay_s = delay_s  # how long each answer takes (or a prompt's answer)
        self.failures = {k: list(v) for k, v in (failures or {}).items()}
        self.gate = gate
        self.ungated = ungated or set()
        self.tokens = tokens
        self.calls: Counter[str] = Counter()
        self.params: list[GenerationParams] = []  # what each call was sent with
        self.sent: list[PromptRecord] = []  # every record asked for, in the order asked
        self.inflight = 0
        self.most_inflight = 0
        self.cancelled = 0
        self.closed = False
        self._lock = threading.Lock()

    def drawing(self, record: PromptRecord, params: GenerationParams) -> Drawn | str:
        return NO_TOKEN_IDS  # a chat endpoint's fake: answers start over

    def refusal(self, record: PromptRecord, params: GenerationParams) -> str | None:
        return NO_TOKEN_IDS

    async def chat(
        self,
        record: PromptRecord,
        params: GenerationParams,
        timeout_s: float | None = None,
        on_begun: Callable[[], None] | None = None,
        on_tokens: Callable[[int], None] | None = None,
        drawn: Drawn | None = None,
    ) -> ChatResult:
        with self._lock:
            self.calls[record.id] += 1
            self.params.append(params)
            self.sent.append(record)
            self.inflight += 1
            self.most_inflight = max(self.most_inflight, self.inflight)
            scripted = self.failures.get(record.id)
            failure = scripted.pop(0) if scripted else None
        try:
            if failure is not None:
                raise failure
            delay_s = self.delay_s(record) if callable(self.delay_s) else self.delay_s
            if delay_s:
                await asyncio.sleep(delay_s)
            if self.gate is not None and record.id not in self.ungated:
                deadline = time.monotonic() + GATE_DEADLINE_S
                while not self.gate.is_set():
                    if time.monotonic() > deadline:
                        raise AssertionError("the test never opened the gate")
                    await asyncio.sleep(0.002)
            if on_begun is not None:
                on_begun()  # the whole answer at once: it begins as it ends
            return answer(record, self.tokens)
        except asyncio.CancelledError:
            with self._lock:
                self.cancelled += 1
            raise
        finally:
            with self._lock:
                self.inflight -= 1

    async def aclose(self) -> None:
        self.closed = True


class FakeEngine:
    """A supervisor that is up; `wait_up` counts its calls and raises `down` when set."""

    def __init__(self, down: BaseException | None = None) -> None:
        self.state = "ready"
        self.down = down
        self.waits = 0
        self.deaths = 0
        self.crashes = 0
        self.forgiven = 0  # restarts forgiven for blamed prompts
        self.last_error: str | None = None

    def alive(self) -> bool:
        return True

    def wait_up(self, timeout_s: float) -> None:
        self.waits += 1
        if self.down is not None:
            raise self.down

    def forgive(self, restarts: int) -> None:
        self.forgiven += restarts


def _protocols(chat: FakeChat, engine: FakeEngine) -> tuple[ChatClient, EngineHandle]:
    return chat, engine  # a type checker sees here that the fakes satisfy the protocols


class CrashingEngine:
    """An engine in memory that crashes as it receives a prompt holding one of `poison` (every
    request then in flight fails as a reset connection would), or that a test kills from
    outside (`kill(crash=False)`): the feeder's chat client and supervisor handle in one.
    Other prompts are answered `answer_s` after they arrive, unless it dies first. A poison
    takes `crash_after_s` to crash it (its prefill): prompts sent meanwhile are in flight at
    the crash, sent after the poison."""

    def __init__(
        self,
        poison: set[str],
        answer_s: float,
        crash_after_s: float = 0.0,
        begins_after_s: float | None = None,
    ) -> None:
        self.model = "fake-model"
        self.state = "ready"
        self.deaths = 0
        self.crashes = 0
        self.forgiven = 0  # restarts forgiven for blamed prompts
        self.last_error: str | None = None
        self.poison = poison
        self.answer_s = answer_s
        self.crash_after_s = crash_after_s
        # A prompt in flight this long has begun its answer (output streamed): at a death it
        # fails as AnswerInterrupted. None: nothing streams, every death is a plain EngineDown.
        self.begins_after_s = begins_after_s
        self.sent: Counter[str] = Counter()
        self.events: list[tuple[float, str, str]] = []  # (monotonic, "sent" | "begun", id)
        self.inflight: set[str] = set()
        self._generation = 0  # one more at each death: the requests of an older one fail

    def alive(self) -> bool:
        return True

    def wait_up(self, timeout_s: float) -> None:
        return None  # back at once

    def forgive(self, restarts: int) -> None:
        self.forgiven += restarts

    def kill(self, crash: bool) -> None:
        """The engine dies: by its own crash (an error in its log), or killed from outside."""
        self.deaths += 1
        self.crashes += crash
        self.last_error = "RuntimeError: poisoned" if crash else "engine exited with code -9"
        self._generation += 1

    def drawing(self, record: PromptRecord, params: GenerationParams) -> Drawn | str:
        return NO_TOKEN_IDS  # a chat endpoint's fake: answers start over

    def refusal(self, record: PromptRecord, params: GenerationParams) -> str | None:
        return NO_TOKEN_IDS

    async def chat(
        self,
        record: PromptRecord,
        params: GenerationParams,
        timeout_s: float | None = None,
        on_begun: Callable[[], None] | None = None,
        on_tokens: Callable[[int], None] | None = None,
        drawn: Drawn | None = None,
    ) -> ChatResult:
        self.sent[record.id] += 1
        self.events.append((time.monotonic(), "sent", record.id))
        generation = self._generation
        text = str(record.messages)
        if any(marker in text for marker in self.poison):
            await asyncio.sleep(self.crash_after_s)
            if self._generation == generation:  # else it died of something else first
                self.kill(crash=True)
            await asyncio.sleep(0.01)  # its own connection the last to see it: no help given
            raise EngineDown("engine unreachable: the server disconnected")
        self.inflight.add(record.id)
        try:
            started = time.monotonic()
            deadline = started + self.answer_s
            begun = False
            while time.monotonic() < deadline and self._generation == generation:
                await asyncio.sleep(0.002)
                if not begun and self.begins_after_s is not None:
                    begun = time.monotonic() - started >= self.begins_after_s
                    if begun:
                        self.events.append((time.monotonic(), "begun", record.id))
                        if on_begun is not None:
                            on_begun()
            if self._generation != generation:
                if begun:
                    raise AnswerInterrupted("engine unreachable: the server disconnected")
                raise EngineDown("engine unreachable: the server disconnected")
            return answer(record)
        finally:
            self.inflight.discard(record.id)

    async def aclose(self) -> None:
        return None


def _crashing_protocols(engine: CrashingEngine) -> tuple[ChatClient, EngineHandle]:
    return engine, engine  # a type checker sees here that it is both
