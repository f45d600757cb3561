"""Continuous batching as pure arithmetic: a cap, a FIFO queue and a decode step.

Nothing here sleeps or reads a clock: `now` is a parameter and the HTTP side calls `step()`
once per simulated decode iteration. The numbers (ms are divided by the time scale):

- Without speculative decoding a step takes `base + per_request × running` ms and gives
  every running request 1 token.
- With it (MTP/EAGLE) the step also verifies the draft tokens: it takes
  `base × 1.35 + per_request × running × 0.6 × num_draft_tokens` ms, and each request gains
  1..num_draft_tokens tokens per step, with a mean of `accept_length`.

With `--speculative-adaptive` the draft steps follow the running batch as SGLang's default
adaptive tiers settle at a steady accept rate (`adaptive_spec_params.DEFAULT_ADAPTIVE_CONFIG`):
the launch's steps below 32 running requests, 1 step from 32, none (a plain decode step) from
64. `accept_length` is the mean at the launch's steps; fewer steps accept
`1 + p + … + p^steps` with the per-draft acceptance `p` that gives it.

So MTP wins at low concurrency (≈ accept_length / 1.35 faster per request) and, with its
48-request cap and the dearer verify, loses once a client can keep far more than 48 requests
running: with the defaults (12 ms, 0.25 ms, 2.6) the crossover is near 110 concurrent requests.
Completion lengths are lognormal (heavy tail) with the configured mean, drawn from the prompt
hash, so the same prompt always gets the same length.

Prefill: a sequence's first token comes no earlier than `prompt_tokens / PREFILL_TOKENS_PER_S`
(time-scaled) after its admission, so a long input (a continuation's prompt plus the output
it carries) costs its whole length, as on a real engine; a short prompt fits in the first step.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Literal

from genfleet.workers.engine.emulator.args import SpecConfig

SPEC_BASE_FACTOR = 1.35
SPEC_VERIFY_COST_PER_DRAFT = 0.6
COMPLETION_SIGMA = 0.9
PREFILL_TOKENS_PER_S = 40_000.0  # an H100's prefill rate on a mid-size model, roughly
DECODE_LOG_INTERVAL = 40
# (running requests from, draft steps) of the adaptive tiers; below the first: the launch's steps.
ADAPTIVE_TIERS = (
    (32, 1),
    (64, 0),
)  # decode iterations between folds of throughput and accept length

FinishReason = Literal["stop", "length", "abort"]


@dataclass(frozen=True, slots=True)
class TimeModel:
    """How long a decode step takes and how far it moves each running request."""

    step_base_ms: float
    step_per_request_ms: float
    time_scale: float
    accept_length: float
    spec: SpecConfig | None

    @property
    def zero_time(self) -> bool:
        """Both step costs are zero: requests complete on arrival, no scheduler steps run."""
        return self.step_base_ms == 0 and self.step_per_request_ms == 0

    @property
    def mean_accept(self) -> float:
        """Tokens per request per step: accept_length clipped to [1, draft tokens] under spec."""
        if self.spec is None:
            return 1.0
        return min(max(self.accept_length, 1.0), float(self.spec.num_draft_tokens))

    def steps_for(self, running: int) -> int:
        """Draft steps a decode step with `running` requests runs: fixed, or the adaptive tier."""
        if self.spec is None:
            return 0
        steps = self.spec.num_draft_tokens - 1
        if self.spec.adaptive:
            for start, tier_steps in ADAPTIVE_TIERS:
                if running >= start:
                    steps = min(steps, tier_steps)
        return steps

    def accept_for(self, running: int) -> float:
        """Mean tokens per request of a step with `running` requests (1.0 without drafts)."""
        steps = self.steps_for(running)
        if self.spec is None or steps == self.spec.num_draft_tokens - 1:
            return self.mean_accept
        return accept_at(self.mean_accept, self.spec.num_draft_tokens - 1, steps)

    def step_time_s(self, running: int) -> float:
        """Seconds (already time-scaled) one decode step takes with `running` requests."""
        steps = self.steps_for(running)
        if self.spec is None or (self.spec.adaptive and steps == 0):
            ms = self.step_base_ms + self.step_per_request_ms * running
        else:
            verify = SPEC_VERIFY_COST_PER_DRAFT * (steps + 1)
            ms = self.step_base_ms * SPEC_BASE_FACTOR + self.step_per_request_ms * running * verify
        return ms / 1000.0 / self.time_scale

    def prefill_s(self, input_tokens: int) -> float:
        """Seconds (time-scaled) the prefill of `input_tokens` takes; 0 in zero-time mode."""
        if self.zero_time:
            return 0.0
        return input_tokens / PREFILL_TOKENS_PER_S / self.time_scale

    def tokens_per_s(self, concurrency: int, max_running: int) -> float:
        """Steady-state generation throughput for a client keeping `concurrency` requests open."""
        running = min(concurrency, max_running)
        if running <= 0:
            return 0.0
        step = self.step_time_s(running)
        return math.inf if step == 0 else running * self.accept_for(running) / step


def accept_at(accept: float, steps: int, fewer: int) -> float:
    """Mean accepted tokens with `fewer` draft steps, given `accept` at `steps`.

    Drafts are accepted in order, each with probability p: accept = 1 + p + … + p^steps.
    p is found by bisection (60 halvings: far below a token's precision).
    """
    if fewer <= 0 or steps <= 0:
        return 1.0
    target = min(max(accept, 1.0), steps + 1.0)
    low, high = 0.0, 1.0
    for _ in range(60):
        p = (low + high) / 2
        if sum(p**i for i in range(steps + 1)) < target:
            low = p
        else:
            high = p
    return sum(low**i for i in range(fewer + 1))


def natural_length(seed: int, mean_tokens: int) -> int:
    """A lognormal completion length with mean `mean_tokens`, fixed by `seed`."""
    u1 = ((seed * 2654435761) & 0xFFFFFFFF) / 2**32 or 0.5 / 2**32
    u2 = ((seed * 40503 + 0x9E3779B9) & 0xFFFFFFFF) / 2**32
    z = math.sqrt(-2.0 * math.log(u1)) * math.cos(2.0 * math.pi * u2)
    mu = math.log(mean_tokens) - COMPLETION_SIGMA**2 / 2
    return max(1, round(math.exp(mu + COMPLETION_SIGMA * z)))


def plan_length(
    seed: int,
    mean_tokens: int,
    caps: list[int],
    ignore_eos: bool = False,
    min_tokens: int = 0,
) -> tuple[int, FinishReason]:
    """The tokens a request will generate and why it stops: "length" when a cap cut it."""
    cap = max(0, min(caps))
    natural = cap + 1 if ignore_eos else max(natural_length(seed, mean_tokens), min_tokens)
    if natural >= cap:
        return cap, "length"
    return natural, "stop"


@dataclass(slots=True, eq=False)
class Sequence:
    """One generation in flight: its plan, its progress and its speculative tallies."""

    rid: str
    prompt_tokens: int
    target_tokens: int
    finish_reason: FinishReason
    seed: int
    arrived_s: float
    generated: int = 0
    verify_ct: int = 0
    correct_drafts: int = 0
    histogram: list[int] = field(default_factory=list)
    admitted_s: float | None = None
    first_token_s: float | None = None
    finished_s: float | None = None
    waker: Any = None  # an asyncio.Event of the HTTP request, set when this sequence finishes
    stream: bool = False  # also set the waker once `stream_every` tokens are unsent
    stream_every: int = 1  # --stream-interval
    streamed_at: int = 0  # tokens generated when the waker was last set for the stream
    text_kind: str = "plain"  # "loop", a legit kind (sim/text.py) or "plain"
    loop_at: int = 0  # a loop's first token
    loop_block: int = 0  # a loop's block, in tokens
    prefill_s: float = 0.0  # seconds (time-scaled) from admission before the first token
    answer: Any = None  # /generate: the Answer (sim/answer.py) this sequence writes

    @property
    def done(self) -> bool:
        return self.finished_s is not None


@dataclass(slots=True)
class Tallies:
    """Lifetime counters (the /metrics counters) and the last folded interval (gauges)."""

    steps: int = 0
    requests: int = 0
    aborted: int = 0
    prompt_tokens: int = 0
    generation_tokens: int = 0
    decoded_tokens: int = 0  # every output token stepped, of requests in flight too
    spec_forward_ct: int = 0
    spec_accept_tokens: int = 0
    avg_spec_accept_length: float | None = None
    last_gen_throughput: float = 0.0
    last_spec_accept_length: float = 0.0
    interval_steps: int = 0
    interval_tokens: int = 0
    interval_forward_ct: int = 0
    interval_accept_tokens: int = 0
    interval_start_s: float = 0.0


class Scheduler:
    """A FIFO waiting queue feeding at most `max_running` sequences that one loop steps.

    Examples:
        s = Scheduler(model, max_running=48)
        s.submit(seq, now)            # runs at once if a slot is free, else waits
        finished = s.step(now)        # one decode iteration; call again after step_time_s
    """

    def __init__(self, model: TimeModel, max_running: int, max_queued: int | None = None):
        self.model = model
        self.max_running = max_running
        self.max_queued = max_queued
        self.running: list[Sequence] = []
        self.waiting: deque[Sequence] = deque()
        self.tallies = Tallies()
        self._rng = 0x2545F491

    @property
    def busy(self) -> bool:
        return bool(self.running or self.waiting)

    def queue_full(self) -> bool:
        """True when `--max-queued-requests` is set and a new request would have to wait."""
        return (
            self.max_queued is not None
            and len(self.running) >= self.max_running
            and len(self.waiting) >= self.max_queued
        )

    def submit(self, seq: Sequence, now: float) -> None:
        """Admit `seq` now if a running slot is free, else queue it behind earlier arrivals."""
        self.tallies.prompt_tokens += seq.prompt_tokens
        if self.model.spec is not None:
            seq.histogram = [0] * self.model.spec.num_draft_tokens
        if len(self.running) < self.max_running and not self.waiting:
            seq.admitted_s = now
            self.running.append(seq)
        else:
            self.waiting.append(seq)

    def abort(self, seq: Sequence, now: float) -> None:
        """Drop a sequence whose client went away; it frees its slot at once."""
        if seq.done:
            return
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        seq.finished_s = now
        self.tallies.aborted += 1
        self.tallies.generation_tokens += seq.generated  # spent, even if nobody reads them
        self._fill(now)

    def step(self, now: float) -> list[Sequence]:
        """Advance every running sequence by one decode iteration ending at `now`."""
        if not self.running:
            return []
        spec = self.model.spec
        t = self.tallies
        tokens = 0
        finished: list[Sequence] = []
        mean = self.model.accept_for(len(self.running))
        for seq in self.running:
            if seq.first_token_s is None and seq.prefill_s > 0:
                admitted = seq.admitted_s if seq.admitted_s is not None else now
                if now < admitted + seq.prefill_s:
                    continue  # still prefilling
            take = self._draw(mean) if spec is not None else 1
            take = min(take, seq.target_tokens - seq.generated)
            seq.generated += take
            tokens += take
            if seq.first_token_s is None:
                seq.first_token_s = now
            if spec is not None:
                seq.verify_ct += 1
                seq.correct_drafts += take - 1
                seq.histogram[take - 1] += 1
            if seq.generated >= seq.target_tokens:
                finished.append(seq)
        if spec is not None:
            t.spec_forward_ct += len(self.running)
            t.spec_accept_tokens += tokens
            t.interval_forward_ct += len(self.running)
            t.interval_accept_tokens += tokens
        t.steps += 1
        t.decoded_tokens += tokens
        t.interval_steps += 1
        t.interval_tokens += tokens
        for seq in finished:
            self._finish(seq, now)
        if finished:
            self.running = [seq for seq in self.running if not seq.done]
            self._fill(now)
        return finished

    def complete_now(self, seq: Sequence, now: float) -> None:
        """Zero-time mode: account a whole generation at once, without stepping."""
        self.tallies.prompt_tokens += seq.prompt_tokens
        seq.admitted_s = seq.first_token_s = now
        seq.generated = seq.target_tokens
        spec = self.model.spec
        if spec is not None and seq.target_tokens > 0:
            mean = self.model.mean_accept
            steps = max(1, min(seq.target_tokens, round(seq.target_tokens / mean)))
            base = max(1, min(spec.num_draft_tokens, seq.target_tokens // steps))
            high = min(steps, max(0, seq.target_tokens - steps * base))
            seq.histogram = [0] * spec.num_draft_tokens
            seq.histogram[base - 1] += steps - high
            if high:
                seq.histogram[min(base, spec.num_draft_tokens - 1)] += high
            seq.verify_ct = steps
            seq.correct_drafts = seq.target_tokens - steps
            t = self.tallies
            t.spec_forward_ct += steps
            t.spec_accept_tokens += seq.target_tokens
            t.interval_forward_ct += steps
            t.interval_accept_tokens += seq.target_tokens
            t.interval_steps += steps
        self.tallies.interval_tokens += seq.target_tokens
        self.tallies.decoded_tokens += seq.target_tokens
        self._finish(seq, now)

    def due_fold(self) -> bool:
        """True once DECODE_LOG_INTERVAL iterations ran since the last fold (SGLang's cadence)."""
        return self.tallies.interval_steps >= DECODE_LOG_INTERVAL

    def fold(self, now: float) -> None:
        """Publish the interval: gen throughput, accept length (interval and lifetime)."""
        t = self.tallies
        elapsed = now - t.interval_start_s
        if elapsed > 0:
            t.last_gen_throughput = t.interval_tokens / elapsed
        if t.interval_forward_ct:
            t.last_spec_accept_length = t.interval_accept_tokens / t.interval_forward_ct
        if t.spec_forward_ct:
            t.avg_spec_accept_length = t.spec_accept_tokens / t.spec_forward_ct
        t.interval_steps = t.interval_tokens = 0
        t.interval_forward_ct = t.interval_accept_tokens = 0
        t.interval_start_s = now

    def _finish(self, seq: Sequence, now: float) -> None:
        seq.finished_s = now
        self.tallies.requests += 1
        self.tallies.generation_tokens += seq.generated

    def _fill(self, now: float) -> None:
        while self.waiting and len(self.running) < self.max_running:
            seq = self.waiting.popleft()
            seq.admitted_s = now
            self.running.append(seq)

    def _draw(self, mean: float) -> int:
        """Tokens one verify yields: floor or ceil of the mean accept, the mix giving the mean."""
        self._rng = (self._rng * 1103515245 + 12345) & 0x7FFFFFFF
        base = int(mean)
        return base + 1 if self._rng / 0x80000000 < mean - base else base
