"""What the repetition guard saves: one run with it off, one with it on, side by side.

The same prompts, each run against a fresh emulator with the same knobs: 5 % of prompts
fall into a loop (one block repeated until max_tokens) after 64 to 1,200 tokens, 10 % answer
with legitimate repetition (tables, lists, code, a refrain, an enumeration), the rest plain;
`--stream-interval 32`, max_tokens 8192. Each run sends every prompt through a `Feeder` and
the `EngineClient` (streaming either way; the guard is the only difference). Which prompts
loop is the emulator's own plan for each prompt, read with its functions: the truth the guard
is held to.

Figures per run: tokens generated (the engine's `generation_tokens_total`, which counts what a
stopped request generated before its abort landed), seconds, loops caught and missed, false
stops (an answer stopped that was not a loop: must be 0), and with the guard on
`tokens_saved_share` (the budget stopped loops did not spend, over what the run would have
generated without the guard) and `generated_on_vs_off`.

The emulator's legitimate texts always vary, so its "0 false stops" cannot fail; the labelled
corpus of real texts (`tests/data/repetition/`, `harness/repetition_corpus.py`) can.
Each text streams in 128-character chunks through the guard with its prompt, the guard
without it, and a re-implementation of vLLM's rule under three profiles
(`bench/_vllm_repetition.py`): false stops (legit texts stopped) and loop catch (loops
stopped within 2,000 tokens of their start, tokens estimated as `token_estimate`). Last, the
guard's cost: microseconds per 128-character chunk over a short and a long answer (the same:
the cost does not grow with the answer).

    python bench/waste.py            # 2,000 prompts
    python bench/waste.py --quick    # 600 prompts, under a minute
    python bench/waste.py --corpus-only

The last lines are `false_stops: 0`, `tokens_saved_share: X`, `generated_on_vs_off: R`,
`corpus_false_stops: 0` and `corpus_loop_catch: C`.
"""

from __future__ import annotations

import argparse
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench._emulator import Emulator, read_metric  # noqa: E402
from bench._vllm_repetition import PROFILES, VllmRepetition  # noqa: E402
from bench.client_overhead import AlwaysUp  # noqa: E402
from genfleet.common.records import CompletionRecord, GenerationParams, PromptRecord  # noqa: E402
from genfleet.workers.engine.emulator.sim.text import (  # noqa: E402
    chat_prompt,
    draw_text_kind,
    prompt_seed,
    synth_text,
)
from genfleet.workers.feeding.client import EngineClient  # noqa: E402
from genfleet.workers.feeding.feeder import Feeder  # noqa: E402
from genfleet.workers.feeding.repetition import RepetitionDetector, RepetitionRule  # noqa: E402
from harness.repetition_corpus import CHUNK_CHARS, load_corpus, score  # noqa: E402

LOOP_RATE = 0.05
LEGIT_RATE = 0.10
MAX_TOKENS = 8192
CAP = 64
KNOBS = {
    "emulator_time_scale": 100,
    "emulator_load_s": 0,
    "emulator_warmup_s": 0,
    "emulator_mean_completion_tokens": 600,
    "emulator_max_completion_tokens": MAX_TOKENS,
    "emulator_loop_rate": LOOP_RATE,
    "emulator_legit_repeat_rate": LEGIT_RATE,
}
PARAMS = GenerationParams(max_tokens=MAX_TOKENS, temperature=0.6, top_p=0.95, thinking=True)


def prompts(count: int) -> list[PromptRecord]:
    return [
        PromptRecord(f"w{i:06d}", [{"role": "user", "content": f"Task {i}: tabulate {i} facts."}])
        for i in range(count)
    ]


def planned_loops(records: list[PromptRecord]) -> set[str]:
    """The prompts the emulator will make loop (its plan, from each prompt's seed)."""
    loops = set()
    for record in records:
        key, _ = chat_prompt(record.messages, thinking=True)
        if draw_text_kind(prompt_seed(key, 0), LOOP_RATE, LEGIT_RATE) == "loop":
            loops.add(record.id)
    return loops


def emulator() -> Emulator:
    argv = [
        sys.executable, "-m", "genfleet.workers.engine.emulator", "--model-path", "bench-model",
        "--max-running-requests", str(CAP), "--reasoning-parser", "qwen3", "--enable-metrics",
        "--stream-interval", "32", "--log-level", "warning",
    ]  # fmt: skip
    engine = Emulator(KNOBS, CAP, argv=argv)
    engine.wait_ready()
    return engine


@dataclass
class Figures:
    records: int
    errors: int
    seconds: float
    generated: int  # the engine's generation_tokens_total
    stopped: set[str]  # ids of answers stopped as loops
    saved: int  # their tokens_saved


def run(records: list[PromptRecord], guard: bool) -> Figures:
    """One run: every record through a Feeder against a fresh emulator."""
    engine = emulator()
    rule = RepetitionRule() if guard else None
    done: list[CompletionRecord] = []
    lock = threading.Lock()

    def on_record(index: int, record: CompletionRecord) -> None:
        with lock:
            done.append(record)

    try:
        feeder = Feeder(
            lambda: EngineClient(engine.url, model="bench-model", repetition=rule),
            AlwaysUp(),
            CAP + 16,
        )
        started = time.perf_counter()
        try:
            feeder.run_batch("waste", "b0", records, PARAMS, on_record).result()
        finally:
            feeder.close()
        elapsed = time.perf_counter() - started
        metrics = httpx.get(engine.url + "/metrics", timeout=10).text
    finally:
        engine.stop()
    stopped = [r for r in done if r.finish_reason == "repetition"]
    return Figures(
        records=len(done),
        errors=sum(1 for r in done if r.error),
        seconds=elapsed,
        generated=int(read_metric(metrics, "generation_tokens_total") or 0),
        stopped={r.id for r in stopped},
        saved=sum(int((r.repetition or {}).get("tokens_saved") or 0) for r in stopped),
    )


def corpus() -> None:
    """False stops and loop catch on the labelled corpus of real texts, guard and vLLM's rule."""
    texts = load_corpus()
    rule = RepetitionRule()
    print(
        f"corpus: {sum(t.label == 'legit' for t in texts)} legit texts, "
        f"{sum(t.label == 'loop' for t in texts)} loops ({CHUNK_CHARS}-character chunks)"
    )
    guard = score(texts, lambda prompt: RepetitionDetector(rule, prompt))
    print(f"  guard, with the prompt: {guard.line()}")
    blind = score(texts, lambda prompt: RepetitionDetector(rule, prompt), with_prompt=False)
    print(f"  guard, prompt withheld: {blind.line()}")
    for profile in PROFILES:
        vllm = score(texts, lambda _prompt, p=profile: VllmRepetition(p))  # type: ignore[misc]
        print(f"  {profile.name}: {vllm.line()}")
    for name, figures in (("guard", guard), ("guard, prompt withheld", blind)):
        if figures.false_stops or figures.late or figures.missed:
            print(
                f"  {name}: false stops {figures.false_stops}, late {figures.late}, "
                f"missed {figures.missed}"
            )
    print(
        f"guard_us_per_chunk: {cost_per_chunk(20_000):.1f} (20,000-character answer), "
        f"{cost_per_chunk(2_000_000):.1f} (2,000,000)"
    )
    print(f"corpus_false_stops: {len(guard.false_stops)}")
    print(f"corpus_loop_catch: {guard.catch_share:.3f}")


def cost_per_chunk(chars: int) -> float:
    """The guard's microseconds per streamed chunk over an answer of `chars` characters of
    plain text (no loop: every check runs to its end)."""
    text = synth_text(9, chars // 4 + 1)[:chars]
    detector = RepetitionDetector(RepetitionRule(), "Explain the history of the printing press.")
    chunks = [text[at : at + CHUNK_CHARS] for at in range(0, len(text), CHUNK_CHARS)]
    started = time.perf_counter()
    for chunk in chunks:
        detector.feed(chunk)
    return (time.perf_counter() - started) / len(chunks) * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="600 prompts, not 2,000")
    parser.add_argument("--prompts", type=int, default=None)
    parser.add_argument("--corpus-only", action="store_true", help="the real corpus alone")
    args = parser.parse_args()
    if args.corpus_only:
        corpus()
        return
    records = prompts(args.prompts or (600 if args.quick else 2000))
    loops = planned_loops(records)
    off = run(records, guard=False)
    on = run(records, guard=True)
    for name, figures in (("guard off", off), ("guard on", on)):
        print(
            f"{name}: {figures.records:,} records ({figures.errors} errors), "
            f"{figures.generated:,} tokens generated in {figures.seconds:.1f} s, "
            f"{len(figures.stopped & loops)} of {len(loops)} loops caught, "
            f"{len(figures.stopped - loops)} false stops"
        )
    print(f"loops_caught: {len(on.stopped & loops)}/{len(loops)}")
    print(f"false_stops: {len(on.stopped - loops)}")
    print(f"tokens_saved_share: {on.saved / (on.generated + on.saved):.3f}")
    print(f"generated_on_vs_off: {on.generated / off.generated:.3f}")
    corpus()


if __name__ == "__main__":
    main()
