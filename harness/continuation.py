"""Whether an answer continued from its drawn ids is the answer the engine draws in one go,
compared id by id, with no fault in between: each prompt is rendered to ids (`/v1/tokenize`),
drawn whole twice (`/generate`, greedy: the twins), and drawn to `cut` tokens and then on from
prompt + those ids to the same budget (the continuation). All prompts of a pass go at once, as
a worker sends a batch.

The twins say how far two uninterrupted draws agree on this engine; the continuation, how far
going on from ids does. Two twins of the same batch, drawn the same way, agree bit for bit on
an H100 (48 of 48): the fair reference is a twin drawn in another batch composition (the
prompts in halves, `twins_other_batch`), as the answers of a run are: batch size and kernel
choice move low-margin logits, and so does a continuation's prefill of prompt + drawn ids
(the hybrid model's recurrent layers then run their chunked prefill kernel, not the decode
step). A continuation whose first difference from its twin is at the cut, where the twins
agree, is the prefill scoring the next token otherwise than the decode step did.
`distinct_ids_p50` (the median of each first twin's distinct ids) tells a model that draws
text from one that repeats a few ids, where every comparison agrees trivially.

    python3 -m harness.continuation --url http://127.0.0.1:30000 --api-key-env KEY \
        --prompts 48 --budget 768 --cut 193
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
from collections.abc import Sequence
from typing import Any

import httpx


def first_difference(a: Sequence[int], b: Sequence[int]) -> int | None:
    """The index of the first id where `a` and `b` differ (the shorter one's length where one
    is a prefix of the other and they differ in length); None where they are equal."""
    for i, (x, y) in enumerate(zip(a, b, strict=False)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def agreement(
    drawn: Sequence[Sequence[int]], reference: Sequence[Sequence[int]], cut: int
) -> dict[str, Any]:
    """How `drawn` agree with `reference`, answer by answer: how many are identical, and for
    the others where they first differ, counted from the cut (negative: before it)."""
    offsets = []
    for a, b in zip(drawn, reference, strict=True):
        at = first_difference(a, b)
        if at is not None:
            offsets.append(at - cut)
    return {
        "answers": len(drawn),
        "identical": len(drawn) - len(offsets),
        "first_difference_from_cut": sorted(offsets),
        "at_the_cut": sum(1 for o in offsets if o == 0),
    }


class Engine:
    """An engine's `/v1/tokenize` and `/generate`, greedy, with its API key."""

    def __init__(self, client: httpx.AsyncClient, model: str) -> None:
        self.client, self.model = client, model

    async def render(self, text: str) -> list[int]:
        body = {"model": self.model, "messages": [{"role": "user", "content": text}]}
        reply = await self.client.post("/v1/tokenize", json=body)
        reply.raise_for_status()
        return list(reply.json()["tokens"])

    async def draw(self, ids: Sequence[int], max_new_tokens: int) -> list[int]:
        sampling = {"temperature": 0.0, "max_new_tokens": max_new_tokens, "ignore_eos": True}
        body = {"input_ids": list(ids), "sampling_params": sampling}
        reply = await self.client.post("/generate", json=body)
        reply.raise_for_status()
        return list(reply.json()["output_ids"])


async def probe(engine: Engine, texts: Sequence[str], budget: int, cut: int) -> dict[str, Any]:
    """Twins and continuations of `texts`, `budget` tokens each, cut at `cut`: the figures
    of `agreement` for the second twin and for the continuations against the first twin."""
    prompts = await asyncio.gather(*(engine.render(t) for t in texts))

    async def whole() -> list[list[int]]:
        return list(await asyncio.gather(*(engine.draw(p, budget) for p in prompts)))

    async def halves() -> list[list[int]]:
        half = len(prompts) // 2 or 1
        drawn: list[list[int]] = []
        for part in (prompts[:half], prompts[half:]):
            drawn.extend(await asyncio.gather(*(engine.draw(p, budget) for p in part)))
        return drawn

    first, second = await whole(), await whole()
    other = await halves()
    heads = await asyncio.gather(*(engine.draw(p, cut) for p in prompts))
    tails = await asyncio.gather(
        *(engine.draw([*p, *h], budget - len(h)) for p, h in zip(prompts, heads, strict=True))
    )
    continued = [[*h, *t] for h, t in zip(heads, tails, strict=True)]
    distinct = sorted(len(set(f)) for f in first)
    return {
        "budget": budget,
        "cut": cut,
        "distinct_ids_p50": distinct[len(distinct) // 2] if distinct else 0,
        "heads_vs_twin": agreement(heads, [f[:cut] for f in first], cut),
        "twins": agreement(second, first, cut),
        "twins_other_batch": agreement(other, first, cut),
        "continued_vs_twin": agreement(continued, first, cut),
    }


def texts(count: int) -> list[str]:
    return [f"Question {i}: explain, step by step, why the sky is blue." for i in range(count)]


async def main(args: argparse.Namespace) -> dict[str, Any]:
    key = os.environ.get(args.api_key_env) if args.api_key_env else None
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    limits = httpx.Limits(max_connections=args.prompts + 8)
    async with httpx.AsyncClient(
        base_url=args.url, headers=headers, timeout=args.timeout_s, limits=limits
    ) as client:
        return await probe(Engine(client, args.model), texts(args.prompts), args.budget, args.cut)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--url", required=True)
    parser.add_argument("--model", default="default")
    parser.add_argument("--api-key-env", help="the environment variable holding the API key")
    parser.add_argument("--prompts", type=int, default=48)
    parser.add_argument("--budget", type=int, default=768)
    parser.add_argument("--cut", type=int, default=193)
    parser.add_argument("--timeout-s", type=float, default=600.0)
    print(json.dumps(asyncio.run(main(parser.parse_args()))))
