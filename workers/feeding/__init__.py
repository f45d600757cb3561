"""The engine path: a worker's prompts on their way into its engine and their answers back.

`Feeder` keeps the engine full (one asyncio loop, one in-flight limiter, the suspect lane for
prompts that may have killed it); `EngineClient` sends one chat completion and maps every
answer at the seam; `NativeClient` draws one by token ids through SGLang's native API, so
that a cut answer goes on from its ids (`Drawn`; `copy_of` and `Mark`: what a batch's
checkpoint and journal keep of it). Both go over a `Transport` (aiohttp) that
reads the stream (`ChatStream`, `GenerateStream`), which the repetition guard watches;
`DeadlinePolicy` gives each request its deadline. Code outside this room enters through the
names below (an import-linter contract holds it so).
"""

from genfleet.workers.feeding.client import ChatResult, EngineClient, ThinkingSwitch
from genfleet.workers.feeding.deadline import DeadlinePolicy
from genfleet.workers.feeding.drawn import Drawn, Mark, copy_of
from genfleet.workers.feeding.feeder import Feeder, default_max_inflight
from genfleet.workers.feeding.native import (
    NativeClient,
    draws_by_ids,
    engine_reasoning_parser,
    splits_reasoning,
)
from genfleet.workers.feeding.repetition import repetition_rule

__all__ = [
    "ChatResult",
    "DeadlinePolicy",
    "Drawn",
    "EngineClient",
    "Feeder",
    "Mark",
    "NativeClient",
    "ThinkingSwitch",
    "copy_of",
    "default_max_inflight",
    "draws_by_ids",
    "engine_reasoning_parser",
    "repetition_rule",
    "splits_reasoning",
]
