"""The feeder, in process: its limiter, its retries when the engine goes down, cancelling.

A real `Feeder` (its asyncio loop on its own thread) drives tests/fakes' FakeChat; no engine
process, no HTTP. What is checked is what the feeder hands back (records by index, the batch
future's outcome) and what the fake engine saw (calls, requests in flight, cancellations).
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import CancelledError, Future

import pytest

from genfleet.common.errors import (
    BatchTerminated,
    EngineDown,
    RequestFailed,
    RequestRejected,
    RestartBudgetExhausted,
)
from genfleet.common.records import CompletionRecord, GenerationParams, PromptRecord
from genfleet.workers.feeding import feeder as feeder_module
from genfleet.workers.feeding.client import ChatResult
from genfleet.workers.feeding.drawn import Drawn
from genfleet.workers.feeding.feeder import Feeder, default_max_inflight, retry_backoff_s
from harness.waits import wait_for
from tests.fakes.engine import CrashingEngine, FakeChat, FakeEngine, answer
from tests.support.core import PARAMS

IDENTITY = {"kind": "fake", "worker": "w@test"}


def prompts(count: int, prefix: str = "p") -> list[PromptRecord]:
    return [
        PromptRecord(id=f"{prefix}{i}", messages=[{"role": "user", "content": f"q{i}"}])
        for i in range(count)
    ]


class Collected:
    """`on_record` for a batch: records by index, thread-safe."""

    def __init__(self) -> None:
        self.records: dict[int, CompletionRecord] = {}
        self._lock = threading.Lock()

    def __call__(self, index: int, record: CompletionRecord) -> None:
        with self._lock:
            assert index not in self.records, f"prompt {index} answered twice"
            self.records[index] = record


@pytest.fixture
def make_feeder() -> Iterator[Callable[..., Feeder]]:
    started: list[Feeder] = []
    backoffs: list[int] = []

    def make(chat: FakeChat, engine: FakeEngine | None = None, **options: object) -> Feeder:
        options.setdefault("backoff_s", lambda attempt: backoffs.append(attempt) or 0.0)
        feeder = Feeder(lambda: chat, engine or FakeEngine(), 4, identity=IDENTITY, **options)  # type: ignore[arg-type]
        started.append(feeder)
        return feeder

    yield make
    for feeder in started:
        feeder.close()


def run(
    feeder: Feeder, records: list[PromptRecord], batch: str = "batch-000000"
) -> tuple[Future[None], Collected]:
    collected = Collected()
    return feeder.run_batch("r", batch, records, PARAMS, collected), collected


def test_every_prompt_becomes_its_record_at_its_index(make_feeder: Callable[..., Feeder]) -> None:
    chat = FakeChat(tokens=5)
    feeder = make_feeder(chat)
    records = prompts(10)

    future, got = run(feeder, records)
    future.result(timeout=10)

    assert sorted(got.records) == list(range(10))
    for index, record in got.records.items():
        assert (record.id, record.run, record.batch) == (f"p{index}", "r", "batch-000000")
        assert record.content == f"answer to p{index}#0" and record.error is None
        assert record.messages == records[index].messages
        assert record.engine == IDENTITY and record.request_id == f"req-p{index}"
    assert feeder.tokens_total == 50
    assert dict(chat.calls) == {f"p{i}": 1 for i in range(10)}


def test_the_limiter_caps_requests_in_flight_across_batches(
    make_feeder: Callable[..., Feeder],
) -> None:
    gate = threading.Event()
    chat = FakeChat(gate=gate)
    feeder = make_feeder(chat)  # max_inflight 4

    first, got_first = run(feeder, prompts(6, "a"), "batch-000000")
    second, got_second = run(feeder, prompts(6, "b"), "batch-000001")
    wait_for(lambda: chat.inflight == 4, 10, "four requests in flight", 0.01)
    assert feeder.inflight == 4
    assert sum(chat.calls.values()) == 4  # the other eight wait on the limiter, not the engine
    gate.set()
    first.result(timeout=10)
    second.result(timeout=10)

    assert chat.most_inflight == 4
    assert len(got_first.records) == len(got_second.records) == 6
    assert feeder.inflight == 0


def test_a_refused_prompt_is_an_error_record_and_the_batch_goes_on(
    make_feeder: Callable[..., Feeder],
) -> None:
    refused = RequestRejected(400, "context_length_exceeded", "prompt longer than 4096 tokens")
    chat = FakeChat(failures={"p1": [refused]})
    feeder = make_feeder(chat)

    future, got = run(feeder, prompts(3))
    future.result(timeout=10)

    error = got.records[1]
    assert error.error == {"type": "context_length_exceeded", "message": str(refused)}
    assert error.content is None and error.model == "fake-model"
    assert got.records[0].error is None and got.records[2].error is None
    assert chat.calls["p1"] == 1  # refused is final: never retried
    assert feeder.tokens_total == 14


def test_engine_down_waits_for_the_engine_and_retries(
    make_feeder: Callable[..., Feeder],
) -> None:
    chat = FakeChat(failures={"p2": [EngineDown("connection refused")] * 2})
    engine = FakeEngine()
    feeder = make_feeder(chat, engine, retries=5)

    future, got = run(feeder, prompts(4))
    future.result(timeout=10)

    assert chat.calls["p2"] == 3
    assert engine.waits == 2
    assert got.records[2].content == "answer to p2#0"
    assert len(got.records) == 4


def test_engine_down_past_the_retry_budget_fails_the_batch(
    make_feeder: Callable[..., Feeder],
) -> None:
    chat = FakeChat(failures={"p0": [EngineDown("connection refused")] * 10})
    engine = FakeEngine()
    feeder = make_feeder(chat, engine, retries=2)

    future, _got = run(feeder, prompts(1))
    with pytest.raises(ExceptionGroup) as caught:
        future.result(timeout=10)

    assert caught.group_contains(EngineDown)
    assert chat.calls["p0"] == 3  # the first try and two retries
    assert engine.waits == 2
    assert feeder.inflight == 0


def test_an_engine_that_cannot_come_back_fails_the_batch(
    make_feeder: Callable[..., Feeder],
) -> None:
    chat = FakeChat(failures={"p0": [EngineDown("connection refused")]})
    feeder = make_feeder(chat, FakeEngine(down=RestartBudgetExhausted("budget spent")))

    future, _got = run(feeder, prompts(2))
    with pytest.raises(ExceptionGroup) as caught:
        future.result(timeout=10)

    assert caught.group_contains(RestartBudgetExhausted)
    assert chat.calls["p0"] == 1


def test_cancel_all_stops_running_batches_and_keeps_what_finished(
    make_feeder: Callable[..., Feeder],
) -> None:
    gate = threading.Event()
    chat = FakeChat(gate=gate, ungated={"p0", "p1"})
    feeder = make_feeder(chat)

    future, got = run(feeder, prompts(8))
    wait_for(lambda: len(got.records) == 2 and chat.inflight == 4, 10, "2 done, 4 running", 0.01)

    assert feeder.cancel_all() == 1
    with pytest.raises(CancelledError):
        future.result(timeout=10)
    wait_for(lambda: chat.inflight == 0, 10, "the cancelled requests to stop", 0.01)
    assert chat.cancelled == 4
    assert sorted(got.records) == [0, 1]
    assert feeder.inflight == 0
    assert feeder.cancel_all() == 0  # nothing left running
    gate.set()


def test_a_terminated_batch_ends_in_batch_terminated_and_leaves_the_others(
    make_feeder: Callable[..., Feeder],
) -> None:
    """An operator's terminate is a fact the batch's future carries (BatchTerminated), not a
    plain cancellation that reads like a shutdown; the other batch of the worker goes on."""
    gate = threading.Event()
    chat = FakeChat(gate=gate, ungated={"p0", "q0", "q1"})
    feeder = make_feeder(chat)
    doomed, got = run(feeder, prompts(3), batch="batch-000001")
    other, rest = run(feeder, prompts(2, prefix="q"), batch="batch-000002")
    wait_for(lambda: 0 in got.records and len(rest.records) == 2, 10, "p0, q0, q1 done", 0.01)

    assert feeder.cancel_batch("r", "batch-000001")
    with pytest.raises(BatchTerminated, match="terminated by an operator"):
        doomed.result(timeout=10)
    wait_for(lambda: chat.inflight == 0, 10, "the terminated requests to stop", 0.01)
    assert other.result(timeout=10) is None
    assert not feeder.cancel_batch("r", "batch-000001")  # no longer running
    gate.set()


def test_a_batch_terminated_before_its_loop_task_starts_never_sends(
    make_feeder: Callable[..., Feeder],
) -> None:
    chat = FakeChat()
    feeder = make_feeder(chat)
    held, release = threading.Event(), threading.Event()
    feeder.submit(_hold_the_loop(held, release))  # no batch task can start meanwhile
    assert held.wait(10)
    future, got = run(feeder, prompts(2))
    assert feeder.cancel_batch("r", "batch-000000")
    release.set()
    with pytest.raises(BatchTerminated):
        future.result(timeout=10)
    assert chat.calls == {} and got.records == {}


async def _hold_the_loop(held: threading.Event, release: threading.Event) -> None:
    held.set()
    release.wait(10)  # blocks the feeder's loop on purpose, until released


def test_close_closes_the_client(make_feeder: Callable[..., Feeder]) -> None:
    chat = FakeChat()
    feeder = make_feeder(chat)
    feeder.close()
    assert chat.closed


@pytest.mark.parametrize(("cap", "expected"), [(None, 64), (0, 64), (48, 64), (256, 324), (1, 5)])
def test_default_max_inflight(cap: int | None, expected: int) -> None:
    assert default_max_inflight(cap) == expected


def test_retry_backoff_doubles_up_to_ten_seconds() -> None:
    assert [retry_backoff_s(a) for a in range(1, 8)] == [0.5, 1.0, 2.0, 4.0, 8.0, 10.0, 10.0]


class RestartedOnce(FakeEngine):
    """An engine that died once with every prompt in flight and is back."""

    def wait_up(self, timeout_s: float) -> None:
        super().wait_up(timeout_s)
        self.deaths = 1


def test_after_a_death_the_suspects_go_back_as_they_survive_not_as_they_finish(
    make_feeder: Callable[..., Feeder], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Four prompts were in flight when the engine died: suspects, sent again one at a time
    at first. Each that outlives its arrival in the engine widens the lane, so all four run
    again long before any of them finishes (a completion can take minutes: waiting for one
    kept the engine nearly empty that long after every restart)."""
    monkeypatch.setattr(feeder_module, "SUSPECT_PROBE_S", 0.2, raising=False)
    gate = threading.Event()
    records = prompts(4)
    chat = FakeChat(failures={r.id: [EngineDown("connection reset")] for r in records}, gate=gate)
    feeder = make_feeder(chat, RestartedOnce(), retries=5)
    future, got = run(feeder, records)
    wait_for(lambda: chat.inflight == 4, 5, "every suspect back in the engine", 0.01)
    assert not got.records
    gate.set()
    future.result(timeout=10)
    assert sorted(got.records) == list(range(4))
    assert all(r.error is None for r in got.records.values())


def crashing_feeder(
    make_feeder: Callable[..., Feeder], engine: CrashingEngine, monkeypatch: pytest.MonkeyPatch
) -> Feeder:
    """A feeder on `engine` that has answered a first batch (so a canary exists)."""
    monkeypatch.setattr(feeder_module, "SUSPECT_PROBE_S", 0.05, raising=False)
    feeder = make_feeder(engine, engine, retries=10)  # type: ignore[arg-type]
    warm, _ = run(feeder, prompts(4, "warm"), "batch-warm")
    warm.result(timeout=10)
    return feeder


def test_a_prompt_that_crashes_the_engine_is_the_one_error_and_no_suspect_beside_it_is(
    make_feeder: Callable[..., Feeder], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The poison arrives with innocents in flight; after the first crash they are all
    suspects, the lane widens as they survive, and the poison crashes the engine again with
    an innocent that had entered the lane alone still in flight (sent just after the poison,
    it ranks first among the suspects). Only the prompt alone among
    suspects at its crash is blamed: the poison, never the innocent joined by it."""
    engine = CrashingEngine(poison={"POISON"}, answer_s=0.3, crash_after_s=0.02)
    feeder = crashing_feeder(make_feeder, engine, monkeypatch)
    records = prompts(4)  # all four in flight at the first crash: every one a suspect
    records[2] = PromptRecord(id="poison", messages=[{"role": "user", "content": "POISON"}])
    future, got = run(feeder, records)
    future.result(timeout=30)
    assert sorted(got.records) == list(range(4))
    errors = {r.id: r.error for r in got.records.values() if r.error is not None}
    assert list(errors) == ["poison"], errors
    assert errors["poison"]["type"] == "engine_crash"
    assert engine.crashes >= 2
    assert engine.forgiven == engine.crashes  # the poison's deaths, forgiven at its blame


class KeptEvidence:
    """The batch's evidence as the next worker finds it (`feeding.feeder.Evidence`): counts
    by `sample:id`, and each death this feeder adds."""

    def __init__(self, counts: dict[str, int]) -> None:
        self.counts = dict(counts)
        self.added: list[str] = []

    def load(self, run: str, batch: str) -> dict[str, int]:
        return dict(self.counts)

    def add(self, run: str, batch: str, record: PromptRecord) -> None:
        self.added.append(record.id)
        key = f"{record.sample}:{record.id}"
        self.counts[key] = self.counts.get(key, 0) + 1


@pytest.mark.parametrize(("carried", "crashes"), [(2, 1), (1, 2)])
def test_deaths_on_an_earlier_worker_count_toward_the_blame(
    make_feeder: Callable[..., Feeder],
    monkeypatch: pytest.MonkeyPatch,
    carried: int,
    crashes: int,
) -> None:
    """A batch comes from a worker whose engine died with its poison arriving: the deaths
    come with it. Two of them: the poison goes alone at once and its first death here blames
    it. One: it goes first among suspects, beside the batch's fresh prompts, then alone."""
    monkeypatch.setattr(feeder_module, "SUSPECT_PROBE_S", 0.05, raising=False)
    engine = CrashingEngine(poison={"POISON"}, answer_s=0.3, crash_after_s=0.02)
    evidence = KeptEvidence({"0:poison": carried})
    feeder = make_feeder(engine, engine, retries=10, evidence=evidence)  # type: ignore[arg-type]
    warm, _ = run(feeder, prompts(4, "warm"), "batch-warm")
    warm.result(timeout=10)
    records = prompts(4)
    records[1] = PromptRecord(id="poison", messages=[{"role": "user", "content": "POISON"}])
    future, got = run(feeder, records)
    future.result(timeout=30)
    errors = {r.id: r.error for r in got.records.values() if r.error is not None}
    assert list(errors) == ["poison"], errors
    assert errors["poison"]["type"] == "engine_crash"
    assert engine.crashes == crashes
    assert engine.sent["poison"] == crashes
    assert evidence.counts["0:poison"] == carried + crashes  # kept for a next worker too
    assert engine.forgiven == crashes  # its deaths here cost no restart budget
    assert all(r.error is None for r in got.records.values() if r.id != "poison")


def test_on_a_worker_that_served_nothing_yet_the_blame_waits_for_another_prompt_served(
    make_feeder: Callable[..., Feeder], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A fresh worker (no prompt answered, so no canary) gets a batch whose poison died twice
    elsewhere: it goes alone first and kills the engine. The engine's serving others is not
    proven yet, so the poison waits out of the lane while the rest of the batch goes; the
    first of them answered, it is blamed, never sent again. (It used to be sent alone again
    at once, nothing else sent meanwhile, until the worker's restart budget was spent.)"""
    monkeypatch.setattr(feeder_module, "SUSPECT_PROBE_S", 0.05, raising=False)
    engine = CrashingEngine(poison={"POISON"}, answer_s=0.3, crash_after_s=0.02)
    evidence = KeptEvidence({"0:poison": 2})
    feeder = make_feeder(engine, engine, retries=10, evidence=evidence)  # type: ignore[arg-type]
    records = prompts(4)
    records[0] = PromptRecord(id="poison", messages=[{"role": "user", "content": "POISON"}])
    future, got = run(feeder, records)
    future.result(timeout=30)
    errors = {r.id: r.error for r in got.records.values() if r.error is not None}
    assert list(errors) == ["poison"], errors
    assert engine.sent["poison"] == 1 and engine.crashes == 1
    assert all(engine.sent[f"p{n}"] == 1 for n in range(1, 4))


def test_kills_from_outside_never_make_a_prompt_an_error(
    make_feeder: Callable[..., Feeder], monkeypatch: pytest.MonkeyPatch
) -> None:
    """One prompt in flight, alone, at two deaths that were kills (SIGKILL from outside, the
    watchdog's): no crash of the engine's own, so no blame; it is answered."""
    engine = CrashingEngine(poison=set(), answer_s=0.5)
    feeder = crashing_feeder(make_feeder, engine, monkeypatch)
    future, got = run(feeder, prompts(1, "x"))
    for send in (1, 2):
        wait_for(lambda s=send: engine.sent["x0"] == s and "x0" in engine.inflight, 10, "x0 sent")
        engine.kill(crash=False)
    future.result(timeout=30)
    assert got.records[0].error is None
    assert engine.sent["x0"] == 3 and engine.deaths == 2


def test_a_suspect_is_not_blamed_for_a_crash_after_it_survived_its_arrival(
    make_feeder: Callable[..., Feeder], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A prompt kills the engine as it arrives. A suspect alone among suspects that was past
    its arrival (its answer begun) when the engine crashes did not cause it (a new poison
    arriving among the fresh prompts did): it is sent again, not made an error record."""
    engine = CrashingEngine(poison=set(), answer_s=0.6, begins_after_s=0.1)
    feeder = crashing_feeder(make_feeder, engine, monkeypatch)
    future, got = run(feeder, prompts(1, "x"))
    wait_for(lambda: engine.sent["x0"] == 1 and "x0" in engine.inflight, 10, "x0 sent")
    engine.kill(crash=True)  # a crash with it in flight, no output yet: a suspect
    wait_for(lambda: engine.sent["x0"] == 2 and "x0" in engine.inflight, 10, "x0 sent again")
    time.sleep(0.25)  # past its arrival (its answer begun), alone in the lane
    engine.kill(crash=True)  # another prompt's crash
    future.result(timeout=30)
    assert got.records[0].error is None
    assert engine.sent["x0"] == 3 and engine.crashes == 2


def test_prompts_whose_answers_had_begun_go_back_at_once_not_through_the_lane(
    make_feeder: Callable[..., Feeder], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Three prompts answering (output streamed) and one just sent when the engine crashes:
    the three were past their arrival, not its cause, and are all back in the engine as soon
    as it is up; only the one still arriving is a suspect, one at a time. Before, all four
    went back one at a time, widening as each survived its arrival."""
    engine = CrashingEngine(poison=set(), answer_s=1.5, begins_after_s=0.1)
    feeder = crashing_feeder(make_feeder, engine, monkeypatch)
    monkeypatch.setattr(feeder_module, "SUSPECT_PROBE_S", 10.0, raising=False)  # no widening
    answering, _ = run(feeder, prompts(3, "a"), "batch-a")
    wait_for(lambda: len(engine.inflight) == 3, 5, "three in flight", 0.005)
    time.sleep(0.2)  # their answers have begun
    arriving, _ = run(feeder, prompts(1, "b"), "batch-b")
    wait_for(lambda: "b0" in engine.inflight, 5, "b0 in flight", 0.001)
    engine.kill(crash=True)
    wait_for(
        lambda: all(engine.sent[f"a{n}"] == 2 for n in range(3)), 2, "all three sent again", 0.005
    )
    answering.result(timeout=10)
    arriving.result(timeout=30)
    assert engine.sent["b0"] == 2


def test_a_suspect_is_not_blamed_for_a_crash_while_fresh_prompts_arrive_beside_it(
    make_feeder: Callable[..., Feeder], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A suspect alone among suspects, sent again as fresh prompts of another batch arrive:
    the engine crashes before any of them has output. Any of the fresh ones may be a poison
    (a new run's), so the suspect is not blamed; it goes alone, and nothing else is sent
    until its answer has begun, then every prompt is answered. Before, only other suspects
    counted, and the suspect was made an `engine_crash` record."""
    engine = CrashingEngine(poison=set(), answer_s=0.8, begins_after_s=0.3)
    feeder = crashing_feeder(make_feeder, engine, monkeypatch)
    monkeypatch.setattr(feeder_module, "SUSPECT_PROBE_S", 5.0, raising=False)
    suspect, got = run(feeder, prompts(1, "x"), "batch-x")
    wait_for(lambda: "x0" in engine.inflight, 10, "x0 sent", 0.002)
    engine.kill(crash=True)  # no output yet: a suspect
    wait_for(lambda: engine.sent["x0"] == 2 and "x0" in engine.inflight, 10, "x0 again", 0.002)
    fresh, fresh_got = run(feeder, prompts(3, "f"), "batch-f")
    wait_for(lambda: len(engine.inflight) == 4, 10, "the fresh ones sent beside it", 0.002)
    assert not any(kind == "begun" and name == "x0" for _, kind, name in engine.events)
    engine.kill(crash=True)  # every one of the four still arriving
    wait_for(lambda: engine.sent["x0"] == 3, 10, "x0 alone", 0.002)
    later, later_got = run(feeder, prompts(2, "g"), "batch-g")  # they wait for its output
    for future in (suspect, fresh, later):
        future.result(timeout=30)
    assert got.records[0].error is None
    assert all(r.error is None for r in [*fresh_got.records.values(), *later_got.records.values()])
    assert engine.sent["x0"] == 3 and engine.sent["g0"] == 1
    # Its third send went alone: nothing sent from it to its first output.
    sent_at = [t for t, kind, name in engine.events if kind == "sent" and name == "x0"][-1]
    begun_at = next(t for t, kind, name in engine.events if kind == "begun" and name == "x0")
    beside = [n for t, kind, n in engine.events if kind == "sent" and sent_at < t < begun_at]
    assert beside == []


class StreamingChat(FakeChat):
    """A chat client that streams its answers as SGLang's do: `chunks` estimated token counts
    through `on_tokens`, held after the first until `gate` opens (prompts in `held`; all
    when None), then its exact `tokens`, or the prompt's `failures` entry, raised after what
    it streamed. A call without `on_tokens` (the feeder's canary) streams nothing."""

    def __init__(
        self,
        chunks: list[int],
        gate: threading.Event,
        *,
        held: set[str] | None = None,
        failures: dict[str, BaseException] | None = None,
        tokens: int = 7,
    ) -> None:
        super().__init__(tokens=tokens)
        self.chunks = chunks
        self.hold = gate
        self.held = held
        self.failing = failures or {}

    async def chat(
        self,
        record: PromptRecord,
        params: GenerationParams,
        timeout_s: float | None = None,
        on_begun: Callable[[], None] | None = None,
        on_tokens: Callable[[int], None] | None = None,
        drawn: Drawn | None = None,
    ) -> ChatResult:
        for i, n in enumerate(self.chunks):
            if on_tokens is None:
                break
            on_tokens(n)
            if i == 0 and on_begun is not None:
                on_begun()
            while i == 0 and (self.held is None or record.id in self.held):
                if self.hold.is_set():
                    break
                await asyncio.sleep(0.002)
        if record.id in self.failing:
            raise self.failing[record.id]
        return answer(record, self.tokens)


def test_tokens_count_as_they_stream_and_settle_to_the_exact_count(
    make_feeder: Callable[..., Feeder],
) -> None:
    """Mid-answer the streamed count holds what streamed while the finished count reads 0; at
    the end an estimate's overshoot (the last chunk was short) is set right."""
    gate = threading.Event()
    chat = StreamingChat([32, 32, 32], gate, tokens=90)  # 96 estimated, 90 generated
    feeder = make_feeder(chat)
    future, collected = run(feeder, prompts(3))
    wait_for(lambda: feeder.streamed_tokens_total == 3 * 32, 10, "the first chunks")
    assert feeder.tokens_total == 0
    gate.set()
    future.result(timeout=10)
    assert [collected.records[i].usage.completion_tokens for i in range(3)] == [90] * 3
    assert feeder.streamed_tokens_total == feeder.tokens_total == 3 * 90


def test_a_failed_answer_keeps_the_tokens_it_streamed(make_feeder: Callable[..., Feeder]) -> None:
    """An aborted answer's tokens were generated: they stay in the streamed count, not in the
    finished one."""
    gate = threading.Event()
    abort = RequestFailed(200, "abort", "aborted after 64 tokens", tokens=64)
    chat = StreamingChat([32, 32], gate, held={"p0"}, failures={"p0": abort}, tokens=7)
    feeder = make_feeder(chat, retries=0)
    future, collected = run(feeder, prompts(2))
    wait_for(lambda: 1 in collected.records, 10, "the answer that succeeds")
    gate.set()  # p0 fails once another prompt succeeded: its error record
    future.result(timeout=10)
    assert collected.records[0].error is not None and collected.records[1].error is None
    assert (feeder.streamed_tokens_total, feeder.tokens_total) == (64 + 7, 7)
