"""A saturating direct client: C requests always in flight, straight at the engine.

    python bench/real_sglang/load.py --url http://127.0.0.1:30000 --model M --concurrency 324 \
        --duration-s 30 --max-tokens 128 [--prompts N] [--stream] [--json-out F]

Either a closed loop for `--duration-s` (measured over the whole window: completion tokens of
the requests that finished in it) or, with `--prompts N`, exactly N prompts (the same texts
`device.sh` enqueues for genfleet) sent with C in flight, timed from the first request to the
last answer: the direct side of "genfleet vs direct". Errors are counted by status, never
retried. `saturate` is also what `crash_probe.py` drives the engine with.

`--stream` asks for answers as genfleet's worker does (SSE, usage in the stream) and reads every
chunk: beside a plain run it tells what streaming costs the engine itself, apart from what it
costs genfleet's client.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import json
import time
from typing import Any

import aiohttp

TOPICS = [
    "hash maps", "lighthouses", "the French Revolution", "derivatives", "sorted lists",
    "the water cycle", "TCP and UDP", "vaccines", "microservices", "gradient descent",
]  # fmt: skip


def prompt(i: int) -> str:
    """The i-th prompt of the bench's dataset (also written for `genfleet enqueue`)."""
    return f"Prompt {i}: explain {TOPICS[i % len(TOPICS)]} in {20 + i % 50} words."


async def _run(
    url: str,
    model: str,
    concurrency: int,
    duration_s: float | None,
    prompts: int | None,
    max_tokens: int,
    alive: Any = None,
    stream: bool = False,
) -> dict[str, Any]:
    statuses: collections.Counter[str] = collections.Counter()
    tokens = 0
    done = 0
    next_index = 0
    started = time.monotonic()
    last_answer = started
    stop_at = started + duration_s if duration_s else None
    timeout = aiohttp.ClientTimeout(total=600)
    connector = aiohttp.TCPConnector(limit=concurrency + 8)

    async def one(session: aiohttp.ClientSession) -> None:
        nonlocal tokens, done, next_index, last_answer
        while True:
            if stop_at is not None and time.monotonic() >= stop_at:
                return
            if prompts is not None and next_index >= prompts:
                return
            if alive is not None and not alive():
                return
            index = next_index
            next_index += 1
            body = {
                "model": model,
                "messages": [{"role": "user", "content": prompt(index)}],
                "max_tokens": max_tokens,
                "temperature": 0.6,
            }
            if stream:
                body["stream"] = True
                body["stream_options"] = {"include_usage": True}
            try:
                async with session.post(f"{url}/v1/chat/completions", json=body) as r:
                    data = await (_streamed(r) if stream else r.json(content_type=None))
                    statuses[str(r.status)] += 1
                    if r.status == 200:
                        if stop_at is None or time.monotonic() <= stop_at:
                            tokens += data["usage"]["completion_tokens"]
                            done += 1
                        last_answer = time.monotonic()
            except (TimeoutError, aiohttp.ClientError) as exc:
                statuses[type(exc).__name__] += 1
                await asyncio.sleep(0.2)

    async with aiohttp.ClientSession(timeout=timeout, connector=connector) as session:
        await asyncio.gather(*(one(session) for _ in range(concurrency)))
    elapsed = (stop_at - started) if stop_at else (last_answer - started)
    return {
        "concurrency": concurrency,
        "stream": stream,
        "max_tokens": max_tokens,
        "elapsed_s": round(elapsed, 2),
        "requests_done": done,
        "completion_tokens": tokens,
        "tokens_per_s": round(tokens / elapsed, 1) if elapsed > 0 else 0.0,
        "statuses": dict(statuses),
    }


async def _streamed(response: aiohttp.ClientResponse) -> dict[str, Any]:
    """Every chunk of an SSE answer decoded; the last usage seen stands for the answer."""
    usage: dict[str, Any] = {"completion_tokens": 0}
    async for line in response.content:
        if not line.startswith(b"data: ") or line.startswith(b"data: [DONE]"):
            continue
        chunk = json.loads(line[6:])
        usage = chunk.get("usage") or usage
    return {"usage": usage}


def saturate(
    url: str,
    model: str,
    concurrency: int,
    max_tokens: int,
    duration_s: float | None = None,
    prompts: int | None = None,
    alive: Any = None,
    stream: bool = False,
) -> dict[str, Any]:
    """Run the load (a window of `duration_s`, or exactly `prompts` requests) and report."""
    return asyncio.run(
        _run(url, model, concurrency, duration_s, prompts, max_tokens, alive, stream)
    )


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--url", required=True)
    parser.add_argument("--model", required=True)
    parser.add_argument("--concurrency", type=int, default=324)
    parser.add_argument("--duration-s", type=float, default=None)
    parser.add_argument("--prompts", type=int, default=None)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--stream", action="store_true", help="SSE answers, as genfleet asks")
    parser.add_argument("--json-out", default=None)
    args = parser.parse_args()
    if (args.duration_s is None) == (args.prompts is None):
        parser.error("give one of --duration-s and --prompts")
    result = saturate(
        args.url,
        args.model,
        args.concurrency,
        args.max_tokens,
        args.duration_s,
        args.prompts,
        stream=args.stream,
    )
    print(json.dumps(result))
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
