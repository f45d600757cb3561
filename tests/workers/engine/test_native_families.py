"""Answers drawn by ids through each family's published chat template (Qwen3, Qwen3.5/3.6,
DeepSeek-V3.1), thinking on and off, cut mid-stream and gone on from: the worker's client
against emulator processes that render those templates (tests/data/chat_templates/).

Per family the template opens the reasoning differently (Qwen3 leaves `<think>` to the model,
Qwen3.5 and DeepSeek-V3.1 open it in the prompt; thinking off closes it there), and the
client must split reasoning from content the same way whatever the cut."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from genfleet.common.errors import AnswerInterrupted, EngineDown
from genfleet.common.records import GenerationParams, PromptRecord
from genfleet.workers.feeding.client import ChatResult, EngineClient, ThinkingSwitch
from genfleet.workers.feeding.drawn import Drawn
from genfleet.workers.feeding.native import NativeClient
from genfleet.workers.feeding.transport import AiohttpTransport, Reply, Sink, Transport
from tests.support.chat_templates import DEEPSEEK, checkpoint
from tests.support.emulator import Emulator, StartEmulator

pytestmark = pytest.mark.integration

FAMILIES: dict[str, tuple[ThinkingSwitch, str, dict[str, Any] | None]] = {
    "qwen3": (ThinkingSwitch("enable_thinking", True), "qwen3", None),
    "qwen3_5": (ThinkingSwitch("enable_thinking", True), "qwen3", None),
    "deepseek_v3_1": (ThinkingSwitch("thinking", False), "deepseek-v3", DEEPSEEK),
}
PROMPTS = [
    PromptRecord(f"p{i}", [{"role": "user", "content": f"Question {i}: why is the sky blue?"}])
    for i in range(4)
]


@pytest.fixture(scope="module")
def engines(
    start_emulator: StartEmulator, tmp_path_factory: pytest.TempPathFactory
) -> dict[str, Emulator]:
    root = tmp_path_factory.mktemp("families")
    env = {"GENFLEET_EMULATOR_MEAN_COMPLETION_TOKENS": "160"}
    return {
        name: start_emulator(
            "--model-path",
            checkpoint(root, name, config),
            "--incremental-streaming-output",
            env=env,
        )
        for name, (_, _, config) in FAMILIES.items()
    }


class Cutting:
    """A transport whose first `/generate` stream breaks after `lines` data lines, as a
    dying engine's would; the next ones pass whole."""

    def __init__(self, inner: Transport, lines: int) -> None:
        self.inner, self.lines = inner, lines

    async def stream(self, body: bytes, sink: Sink, timeout_s: float | None = None) -> Reply:
        if self.lines <= 0:
            return await self.inner.stream(body, sink, timeout_s)
        budget, self.lines = self.lines, 0
        seen = [0]

        class Breaking:
            @property
            def done(self) -> bool:
                return sink.done

            def feed(self, line: bytes) -> bool:
                if line.startswith(b"data:"):
                    seen[0] += 1
                    if seen[0] > budget:
                        raise EngineDown("engine unreachable: the stream was cut")
                return sink.feed(line)

        return await self.inner.stream(body, Breaking(), timeout_s)

    async def aclose(self) -> None:
        await self.inner.aclose()


def client(emu: Emulator, family: str, cut_after: int) -> NativeClient:
    switch, parser, _ = FAMILIES[family]
    chat = EngineClient(emu.base_url, model="m", thinking=switch)
    headers = {"Content-Type": "application/json"}
    tokenize = AiohttpTransport(emu.base_url + "/v1/tokenize", headers, 30.0, 8)
    generate = AiohttpTransport(emu.base_url + "/generate", headers, 60.0, 8)
    detokenize = AiohttpTransport(emu.base_url + "/v1/detokenize", headers, 30.0, 8)
    return NativeClient(
        emu.base_url,
        chat,
        reasoning_parser=parser,
        sampling_defaults={},
        transports=(tokenize, Cutting(generate, cut_after), detokenize),
    )


async def draw(native: NativeClient, record: PromptRecord, params: GenerationParams) -> ChatResult:
    drawn = native.drawing(record, params)
    assert isinstance(drawn, Drawn)
    for _ in range(3):
        try:
            return await native.chat(record, params, drawn=drawn)
        except (AnswerInterrupted, EngineDown):
            continue
    raise AssertionError("never finished")


def answers(emu: Emulator, family: str, thinking: bool, cut_after: int) -> list[ChatResult]:
    params = GenerationParams(max_tokens=300, temperature=0.6, top_p=0.95, thinking=thinking)

    async def go() -> list[ChatResult]:
        results = []
        for record in PROMPTS:
            native = client(emu, family, cut_after)
            try:
                results.append(await draw(native, record, params))
            finally:
                await native.aclose()
        return results

    return asyncio.run(go())


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def family(request: pytest.FixtureRequest) -> Iterator[str]:
    yield request.param


@pytest.mark.parametrize("thinking", [True, False])
@pytest.mark.parametrize("cut_after", [1, 3])
def test_a_cut_answer_is_the_uninterrupted_one_in_every_family(
    engines: dict[str, Emulator], family: str, thinking: bool, cut_after: int
) -> None:
    emu = engines[family]
    whole = answers(emu, family, thinking, 0)
    cut = answers(emu, family, thinking, cut_after)
    for a, b in zip(whole, cut, strict=True):
        assert (b.reasoning, b.content, b.finish_reason) == (
            a.reasoning,
            a.content,
            a.finish_reason,
        )
        assert b.usage == a.usage
        assert a.resumed_tokens == 0
    assert any(b.resumed_tokens for b in cut), "no answer was cut part-way"
    for a in whole:
        text = (a.reasoning or "") + (a.content or "")
        assert "<think>" not in text and "</think>" not in text
        if thinking:
            assert a.reasoning and a.usage.reasoning_tokens > 0
        else:
            assert a.reasoning is None and a.usage.reasoning_tokens == 0


def test_each_family_renders_its_own_prompt(engines: dict[str, Emulator], tmp_path: Path) -> None:
    """The same chat renders to other ids per family (its template, not one built in)."""
    params = GenerationParams(max_tokens=8, temperature=0.6, top_p=0.95, thinking=True)
    rendered = {}
    for family, emu in engines.items():
        native = client(emu, family, 0)
        drawn = native.drawing(PROMPTS[0], params)
        assert isinstance(drawn, Drawn)

        async def once(n: NativeClient = native, d: Drawn = drawn) -> None:
            try:
                await n.chat(PROMPTS[0], params, drawn=d)
            finally:
                await n.aclose()

        asyncio.run(once())
        rendered[family] = tuple(drawn.prompt_ids or ())
    assert len(set(rendered.values())) == len(FAMILIES)
