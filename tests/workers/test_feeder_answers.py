"""What each engine answer does to a prompt and its batch, through the real Feeder and
EngineClient over HTTP, against a small server scripted per prompt; and the limiter's rules.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from typing import Any

import pytest

from genfleet.common.errors import EngineConfigError, EngineDown
from genfleet.common.records import CompletionRecord, PromptRecord
from genfleet.workers.feeding.client import EngineClient
from genfleet.workers.feeding.deadline import DeadlinePolicy
from genfleet.workers.feeding.feeder import Feeder
from genfleet.workers.feeding.limiter import InflightLimiter
from tests.fakes.engine import FakeEngine
from tests.fakes.http_engine import Script, ScriptedEngine, error, ok
from tests.support.core import THINKING_PARAMS


@pytest.fixture
def engine_with() -> Iterator[Callable[[Script], ScriptedEngine]]:
    """`engine_with(script)`: a ScriptedEngine serving `script`, each answer taking 10 ms."""
    engines: list[ScriptedEngine] = []

    def start(script: Script) -> ScriptedEngine:
        engines.append(ScriptedEngine(script))
        engines[-1].delay_s = 0.01
        return engines[-1].start()

    yield start
    for engine in engines:
        engine.stop()


def run_batch(
    engine: ScriptedEngine, count: int, **feeder_args: Any
) -> tuple[Future[None], dict[int, CompletionRecord], Feeder]:
    url = engine.url
    args = {"retries": 2, **feeder_args}
    inflight = args.pop("max_inflight", 8)
    feeder = Feeder(
        lambda: EngineClient(url, model="m", timeout_s=10), FakeEngine(), inflight, **args
    )
    records = [PromptRecord(f"p{i}", [{"role": "user", "content": f"p{i}"}]) for i in range(count)]
    results: dict[int, CompletionRecord] = {}
    future = feeder.run_batch("r", "b", records, THINKING_PARAMS, results.__setitem__)
    try:
        future.exception(timeout=60)
    finally:
        feeder.close()
    return future, results, feeder


def test_backpressure_fails_nothing_and_shrinks_the_limit(
    engine_with: Callable[[Script], ScriptedEngine],
) -> None:
    def script(text: str, n: int) -> tuple[int, Any, dict[str, str]]:
        if n < 2:  # every prompt: a 429, then SGLang's queue-full 503, then an answer
            if n == 0:
                return error(429, "Rate limit reached", **{"Retry-After": "0.05"})
            return error(503, "The request queue is full.")
        return ok(text)

    engine = engine_with(script)
    future, results, feeder = run_batch(engine, 20, max_inflight=8)

    assert future.exception() is None
    assert len(results) == 20
    assert all(r.error is None and r.content == f"answer to {r.id}" for r in results.values())
    assert feeder.busy_total == 40
    assert feeder.inflight_cap < 8  # halved on backpressure, not yet recovered
    assert set(engine.seen.values()) == {3}


def test_a_request_past_its_deadline_is_its_prompts_error_record_never_its_batchs(
    engine_with: Callable[[Script], ScriptedEngine],
) -> None:
    engine = engine_with(lambda text, n: ok(text))
    engine.slow["p3"] = 3.0  # one long completion
    # max_tokens 64 at 1000 tok/s: a deadline of 0.5 + 0.064 s, far below 3 s
    future, results, feeder = run_batch(engine, 8, deadline=DeadlinePolicy(0.5, 1000.0, 1.0))

    assert future.exception() is None  # the batch finished
    assert len(results) == 8
    late = results[3]
    assert late.content is None and late.error is not None
    assert late.error["type"] == "timeout" and "deadline" in late.error["message"]
    assert all(r.error is None for i, r in results.items() if i != 3)
    assert engine.seen["p3"] == 1  # not sent again: waiting once more would cost as long
    assert feeder.timeouts_total == 1


def test_backpressure_past_its_deadline_fails_the_try_never_the_prompt(
    engine_with: Callable[[Script], ScriptedEngine],
) -> None:
    engine = engine_with(lambda text, n: error(429, "busy", **{"Retry-After": "0.05"}))
    future, results, _ = run_batch(engine, 3, busy_timeout_s=0.3)

    group = future.exception()
    assert isinstance(group, BaseExceptionGroup)
    assert isinstance(group.exceptions[0], EngineDown)
    assert results == {}  # no prompt became an error record for it


@pytest.mark.parametrize(
    ("failure", "kind"),
    [
        (lambda: ok("x", finish="abort"), "abort"),
        (lambda: error(500, "CUDA error on this prompt"), "error"),
    ],
    ids=["abort", "500"],
)
def test_a_prompt_failing_every_try_becomes_an_error_record_and_the_batch_goes_on(
    engine_with: Callable[[Script], ScriptedEngine],
    failure: Callable[[], tuple[int, Any, dict[str, str]]],
    kind: str,
) -> None:
    engine = engine_with(lambda text, n: failure() if text == "p3" else ok(text))
    future, results, feeder = run_batch(engine, 6, retries=2)

    assert future.exception() is None
    assert len(results) == 6
    bad = results[3]
    assert bad.error is not None and bad.error["type"] == kind
    assert (bad.content, bad.finish_reason) == (None, None)
    assert engine.seen["p3"] == 3  # the first try and two more
    # the tokens its tries generated (an abort says how many: 5 each) are counted as spent
    spent = 3 * 5 if kind == "abort" else 0
    assert bad.usage.completion_tokens == spent
    assert feeder.waste.tokens["error"] == spent
    good = [r for i, r in results.items() if i != 3]
    assert all(r.error is None and r.finish_reason == "stop" for r in good)


def test_an_abort_then_an_answer_stores_the_answer(
    engine_with: Callable[[Script], ScriptedEngine],
) -> None:
    engine = engine_with(lambda text, n: ok(text, finish="abort") if n == 0 else ok(text))
    future, results, feeder = run_batch(engine, 4)

    assert future.exception() is None
    assert all(r.finish_reason == "stop" and r.error is None for r in results.values())
    assert feeder.failed_tries_total == 4


def test_an_engine_that_serves_nobody_fails_the_batch_not_the_prompts(
    engine_with: Callable[[Script], ScriptedEngine],
) -> None:
    engine = engine_with(lambda text, n: error(500, "broken"))
    future, results, _ = run_batch(engine, 3, retries=1)

    group = future.exception()
    assert isinstance(group, BaseExceptionGroup)
    assert isinstance(group.exceptions[0], EngineDown)
    assert "serves no other prompt" in str(group.exceptions[0])
    assert not any(r.error for r in results.values())


def test_an_abort_before_any_answer_waits_for_the_others_to_be_served(
    engine_with: Callable[[Script], ScriptedEngine],
) -> None:
    """The first answers of a run are long: one prompt aborts (no try left) before any other
    prompt finished and with no canary yet. The others, still running, are waited for; they
    are served, so the aborted prompt is an error record and the batch goes on (before, the
    batch's try failed: "the engine serves no other prompt")."""
    engine = engine_with(lambda text, n: ok(text, finish="abort") if text == "p0" else ok(text))
    for i in range(1, 4):
        engine.slow[f"p{i}"] = 0.5  # they finish well after p0's abort
    future, results, _ = run_batch(engine, 4, retries=0)

    assert future.exception() is None
    assert results[0].error is not None and results[0].error["type"] == "abort"
    assert all(results[i].error is None and results[i].finish_reason == "stop" for i in (1, 2, 3))


def two_batches(
    engine: ScriptedEngine, first: list[str], then: list[str]
) -> tuple[Future[None], dict[int, CompletionRecord]]:
    """Run `first` to the end, then `then`, through one feeder (as one worker does)."""
    url = engine.url
    feeder = Feeder(lambda: EngineClient(url, model="m", timeout_s=10), FakeEngine(), 8, retries=1)
    results: dict[int, CompletionRecord] = {}
    try:
        for texts, out in ((first, {}), (then, results)):
            records = [PromptRecord(t, [{"role": "user", "content": t}]) for t in texts]
            future = feeder.run_batch("r", "b", records, THINKING_PARAMS, out.__setitem__)
            future.exception(timeout=60)
    finally:
        feeder.close()
    return future, results


def test_the_last_failing_prompt_alone_is_judged_by_a_canary(
    engine_with: Callable[[Script], ScriptedEngine],
) -> None:
    """Nothing else is left to run: the last prompt that succeeded, sent again for one token,
    says the engine serves, so the failing prompt is an error record, not a failed batch."""

    def script(text: str, n: int) -> tuple[int, Any, dict[str, str]]:
        return error(500, "poison") if text == "bad" else ok(text)

    engine = engine_with(script)
    engine.slow["b"] = 0.2  # b succeeds last
    future, results = two_batches(engine, ["a", "b"], ["bad"])

    assert future.exception() is None
    assert results[0].error is not None and results[0].error["type"] == "error"
    canary = engine.bodies[-1]  # one token of a prompt that succeeded before
    assert (canary["messages"][0]["content"], canary["max_tokens"]) == ("b", 1)


def test_an_engine_broken_after_serving_fails_the_batch(
    engine_with: Callable[[Script], ScriptedEngine],
) -> None:
    served: set[str] = set()

    def script(text: str, n: int) -> tuple[int, Any, dict[str, str]]:
        if text in {"a", "b"} and text not in served:
            served.add(text)
            return ok(text)
        return error(500, "engine broken")  # everything, the canary included, from now on

    engine = engine_with(script)
    future, results = two_batches(engine, ["a", "b"], ["c", "d"])

    group = future.exception()
    assert isinstance(group, BaseExceptionGroup)
    assert isinstance(group.exceptions[0], EngineDown)
    assert results == {}


@pytest.mark.parametrize("status", [401, 403, 404])
def test_an_engine_refusing_the_worker_stops_the_batch_without_retries(
    engine_with: Callable[[Script], ScriptedEngine], status: int
) -> None:
    engine = engine_with(lambda text, n: error(status, "no"))
    future, results, _ = run_batch(engine, 5, retries=3)

    group = future.exception()
    assert isinstance(group, BaseExceptionGroup)
    assert isinstance(group.exceptions[0], EngineConfigError)
    assert results == {}
    assert max(engine.seen.values()) == 1  # no prompt was sent twice


@pytest.mark.parametrize(
    ("events", "size"),
    [
        ([], 64),
        ([("shrink", 0.0)], 32),
        ([("shrink", 0.0), ("shrink", 0.5)], 32),  # one burst counts once
        ([("shrink", 0.0), ("shrink", 1.0)], 16),
        ([("shrink", 0.0), ("completed", 5.0)], 32),  # still pushing back recently
        ([("shrink", 0.0), ("completed", 10.0), ("completed", 11.0)], 34),
        ([("completed", 1.0)], 64),  # never above the maximum
        ([("shrink", float(t)) for t in range(10)], 1),  # never below one
    ],
)
def test_limiter_shrinks_on_backpressure_and_grows_back(
    events: list[tuple[str, float]], size: int
) -> None:
    limiter = InflightLimiter(64, recover_s=10.0, shrink_spacing_s=1.0)
    for event, now in events:
        getattr(limiter, event)(now)
    assert limiter.size == size


def test_limiter_admits_in_order_up_to_its_size_and_survives_cancellation() -> None:
    async def go() -> list[str]:
        limiter = InflightLimiter(2)
        order: list[str] = []

        async def user(name: str, hold: asyncio.Event) -> None:
            async with limiter:
                order.append(name)
                await hold.wait()

        hold = asyncio.Event()
        tasks = {name: asyncio.create_task(user(name, hold)) for name in "abcd"}
        await asyncio.sleep(0.01)
        assert (limiter.held, order) == (2, ["a", "b"])
        tasks["c"].cancel()  # a waiter leaves: its turn passes to the next
        await asyncio.sleep(0.01)
        hold.set()
        await asyncio.gather(*tasks.values(), return_exceptions=True)
        assert limiter.held == 0
        return order

    assert asyncio.run(go()) == ["a", "b", "d"]
