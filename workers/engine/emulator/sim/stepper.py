"""The emulator's running engine: one task stepping the scheduler against the event-loop clock.

Handlers plan sequences (length checks, completion plan), submit them and wait on one
asyncio.Event per HTTP request; the loop sets it when a sequence advances (streams) or
finishes. In zero-time mode (both step costs 0) nothing is stepped: a sequence is completed
on submission and the handler never waits, so the client-overhead benchmark measures the
HTTP path alone.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import math
import os
import random
import sys
import time
import uuid
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

import orjson

from genfleet.workers.engine.emulator.args import EngineArgs
from genfleet.workers.engine.emulator.request_log import CHAT_ENDPOINT, RequestLog
from genfleet.workers.engine.emulator.routes.error_bodies import ApiError, queue_full
from genfleet.workers.engine.emulator.sim.answer import Answer, Plan, Writer
from genfleet.workers.engine.emulator.sim.chat_template import ChatTemplate
from genfleet.workers.engine.emulator.sim.generation_prompt import derive
from genfleet.workers.engine.emulator.sim.model import (
    Scheduler,
    Sequence,
    TimeModel,
    natural_length,
    plan_length,
)
from genfleet.workers.engine.emulator.sim.power import EnergyMeter, PowerModel
from genfleet.workers.engine.emulator.sim.text import (
    EOS_TOKEN_ID,
    draw_loop,
    draw_text_kind,
    prompt_ids_seed,
)
from genfleet.workers.engine.emulator.sim.tokenizer import SimTokenizer

if TYPE_CHECKING:
    from genfleet.common.settings import Settings

log = logging.getLogger("genfleet.workers.engine.emulator")
TP0 = {"tp": " TP0"}
REASONING_SHARE = 0.7  # of a thinking completion's natural length, up to and with </think>
MAX_CATCH_UP_STEPS = 2000  # decode steps run back to back before yielding to the event loop
DECODE_LOG_MIN_INTERVAL_S = 1.0


@dataclass(frozen=True, slots=True)
class Knobs:
    """The GENFLEET_EMULATOR_* settings, read once at start-up."""

    time_scale: float = 1.0
    mean_completion_tokens: int = 1800
    max_completion_tokens: int = 8192
    load_s: float = 2.0
    warmup_s: float = 1.0
    step_base_ms: float = 12.0
    step_per_request_ms: float = 0.25
    accept_length: float = 2.6
    power_limit_w: float = 700.0
    idle_power_w: float = 80.0
    fail_after_requests: int | None = None
    rate_429: float = 0.0
    retry_after_s: float = 1.0
    abort_rate: float = 0.0
    loop_rate: float = 0.0
    legit_repeat_rate: float = 0.0
    usage_shape: str = "sglang"
    effective_max_running_requests: int | None = None
    request_log: str | None = None
    unclaimed_gpus: int = 0
    foreign_process_mib: int = 0

    @classmethod
    def from_settings(cls, s: Settings) -> Knobs:
        return cls(
            time_scale=s.emulator_time_scale,
            mean_completion_tokens=s.emulator_mean_completion_tokens,
            max_completion_tokens=s.emulator_max_completion_tokens,
            load_s=s.emulator_load_s,
            warmup_s=s.emulator_warmup_s,
            step_base_ms=s.emulator_step_base_ms,
            step_per_request_ms=s.emulator_step_per_request_ms,
            accept_length=s.emulator_accept_length,
            power_limit_w=s.emulator_power_limit_w,
            idle_power_w=s.emulator_idle_power_w,
            fail_after_requests=s.emulator_fail_after_requests,
            rate_429=s.emulator_429_rate,
            retry_after_s=s.emulator_retry_after_s,
            abort_rate=s.emulator_abort_rate,
            loop_rate=s.emulator_loop_rate,
            legit_repeat_rate=s.emulator_legit_repeat_rate,
            usage_shape=s.emulator_usage_shape,
            effective_max_running_requests=s.emulator_effective_max_running_requests,
            request_log=s.emulator_request_log,
            unclaimed_gpus=s.emulator_unclaimed_gpus,
            foreign_process_mib=s.emulator_foreign_process_mib,
        )

    @property
    def health_delay_s(self) -> float:
        """SGLang's /health waits ~1 s for a 1-token generation; here 1 s / time scale, ≤ 1 s."""
        return min(1.0, 1.0 / self.time_scale)


def tokens_file(request_log: str, pid: int) -> str:
    """Beside the request log: the output tokens engine process `pid` has stepped so far, its
    requests in flight included, rewritten at every step. A request killed with its engine
    never logs its end; this says what the engine drew all the same (harness/redone.py)."""
    return f"{request_log}.{pid}.tokens"


def prompt_key(prompt_ids: list[int]) -> str:
    """A /generate prompt's ids as the request log names them: one answer's requests share it,
    whatever they carry of its output."""
    return hashlib.blake2b(orjson.dumps(prompt_ids), digest_size=8).hexdigest()


class Engine:
    """Owns the scheduler, its stepping task, the power meter and the request counters."""

    def __init__(self, args: EngineArgs, knobs: Knobs):
        self.args = args
        self.knobs = knobs
        self.model = TimeModel(
            step_base_ms=knobs.step_base_ms,
            step_per_request_ms=knobs.step_per_request_ms,
            time_scale=knobs.time_scale,
            accept_length=knobs.accept_length,
            spec=args.spec,
        )
        self.scheduler = Scheduler(self.model, self.enforced_max_running, args.max_queued_requests)
        self.power = PowerModel(knobs.idle_power_w, knobs.power_limit_w, args.spec is not None)
        self.clock = asyncio.get_running_loop().time
        self.meter = EnergyMeter(self.clock(), knobs.idle_power_w)
        self.scheduler.tallies.interval_start_s = self.clock()
        self.received = 0
        self._faults = random.Random(0)  # the same run of 429s and aborts every time
        self._request_log = RequestLog(knobs.request_log) if knobs.request_log else None
        self.pid = os.getpid()
        self._tokens_fd: int | None = None
        self._tokens_written = -1
        if knobs.request_log:
            path = tokens_file(knobs.request_log, self.pid)
            self._tokens_fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        self._work = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._last_log_s = -math.inf
        self.tokenizer = SimTokenizer.from_checkpoint(args.model_path)
        self.template = ChatTemplate.from_checkpoint(args.model_path)
        self.family = derive(self.template, self.tokenizer)
        self.writer = Writer(self.tokenizer, self.family.after_think)
        eos = self.tokenizer.eos_id
        self.eos_id = eos if eos is not None else EOS_TOKEN_ID
        self._crash_armed = True  # cleared when --emulator-crash-once finds its file
        log.info(
            "Chat template: %s; generation prompts: %s",
            self.template.origin,
            ", ".join(
                f"{p.start} after {self.tokenizer.decode(p.ids)!r}" for p in self.family.prompts
            )
            or "none",
        )

    @property
    def enforced_max_running(self) -> int:
        """The running-request cap the scheduler enforces: the configured one, or less when
        `effective_max_running_requests` says so (SGLang's KV or mamba pool being short)."""
        effective = self.knobs.effective_max_running_requests
        configured = self.args.max_running_requests
        return min(configured, effective) if effective else configured

    def draw_fault(self) -> str | None:
        """ "429", "abort" or None for the next chat or /generate request, at the configured
        rates (one seeded sequence over both routes, in the order requests arrive)."""
        roll = self._faults.random()
        if roll < self.knobs.rate_429:
            return "429"
        if roll < self.knobs.rate_429 + self.knobs.abort_rate:
            return "abort"
        return None

    def log_request(self, entry: dict[str, Any]) -> None:
        """Append what a request asked and what it got to the request log (`request_log.py`),
        if kept, with how many requests the engine held (running and waiting) when it arrived
        this process (`pid`: an engine restarted under the same log is another) and when (`ts`,
        this host's wall clock: a soak on one machine orders sends and faults by it). Each
        request that ends, finished or aborted, adds an `end` line with the output tokens it
        generated (`log_end`)."""
        if self._request_log is not None:
            s = self.scheduler
            in_engine = len(s.running) + len(s.waiting)
            entry = {**entry, "in_engine": in_engine, "pid": self.pid, "ts": time.time()}
            self._request_log.write(entry)

    def remember_rendering(self, ids: list[int], request: dict[str, Any]) -> None:
        """/v1/tokenize rendered `request`'s messages to `ids`: kept (when a request log is)
        so that a /generate of those ids is logged as the chat it stands for."""
        if self._request_log is not None:
            self._request_log.remember(ids, request)

    def log_generate(
        self,
        input_ids: list[int],
        request: dict[str, Any],
        sampling: dict[str, Any],
        outcome: str,
        rid: str | None,
    ) -> None:
        """Log one /generate prompt (its prompt ids, then any output already drawn) as the
        chat request it stands for; nothing when no log is kept."""
        entry = self.generate_entry(input_ids, request, sampling, outcome, rid)
        if entry is not None:
            self.log_request(entry)

    def generate_entry(
        self,
        input_ids: list[int],
        request: dict[str, Any],
        sampling: dict[str, Any],
        outcome: str,
        rid: str | None,
    ) -> dict[str, Any] | None:
        """The log entry of one /generate prompt (None: no log is kept)."""
        if self._request_log is None:
            return None
        split = self.family.split(input_ids)
        prompt = input_ids[: split.prompt_len]
        entry = self._request_log.generate_entry(
            prompt, split.drawn, request, sampling, self.tokenizer.decode
        )
        # `route`, `prompt` (its ids hashed) and `drawn`: what harness/resends.py counts by
        keyed = {"route": "generate", "prompt": prompt_key(prompt), "drawn": split.drawn}
        return {**entry, **keyed, "outcome": outcome, "id": rid}

    def log_end(self, rid: str, seqs: list[Sequence]) -> None:
        """Request `rid` ended (its sequences finished or aborted): what it generated."""
        generated = sum(seq.generated for seq in seqs)
        self.log_request({"outcome": "end", "id": rid, "generated": generated})

    def _write_tokens(self) -> None:
        """Rewrite the tokens file (`tokens_file`) when the count moved."""
        decoded = self.scheduler.tallies.decoded_tokens
        if self._tokens_fd is not None and decoded != self._tokens_written:
            os.pwrite(self._tokens_fd, b"%20d\n" % decoded, 0)
            self._tokens_written = decoded

    def start(self) -> None:
        if not self.model.zero_time:
            self._task = asyncio.create_task(self._loop(), name="emulator-scheduler")

    async def stop(self) -> None:
        if self._request_log is not None:
            self._request_log.close()
            self._request_log = None
        if self._tokens_fd is not None:
            os.close(self._tokens_fd)
            self._tokens_fd = None
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)

    def count_request(self) -> None:
        """Count a chat/generate request; the N-th one kills the process when a fault is set."""
        self.received += 1
        limit = self.knobs.fail_after_requests
        if limit is not None and self.received >= limit:
            log.error(
                "Emulated engine crash after %d requests (emulator_fail_after_requests).",
                self.received,
                extra=TP0,
            )
            logging.shutdown()
            os._exit(1)

    def check_crash(self, messages: Any) -> None:
        """Die on a chat request whose messages hold `--emulator-crash-on-prompt`."""
        crash = self.args.crash
        if crash is None or crash.on_prompt is None:
            return
        if crash.on_prompt in orjson.dumps(messages).decode():
            body = {"messages": messages}
            entry = {"body": body, "endpoint": CHAT_ENDPOINT, "drawn_tokens": 0}
            self._crash(
                f"RuntimeError: emulated crash on a prompt holding {crash.on_prompt!r}",
                {**entry, "outcome": "crash", "id": None},
            )

    def check_crash_prompt(
        self, prompts: list[list[int]], request: dict[str, Any], sampling: dict[str, Any]
    ) -> None:
        """Die on a /generate request whose prompt (its ids decoded) holds
        `--emulator-crash-on-prompt`, logged as a `crash`."""
        crash = self.args.crash
        if crash is None or crash.on_prompt is None:
            return
        for prompt in prompts:
            if crash.on_prompt in self.tokenizer.decode(prompt):
                self._crash(
                    f"RuntimeError: emulated crash on a prompt holding {crash.on_prompt!r}",
                    self.generate_entry(prompt, request, sampling, "crash", None),
                )

    def streamed(self, tokens: int) -> None:
        """A stream has sent `tokens` output tokens of one sequence: die once that reaches
        `--emulator-crash-after-tokens` (the client has those tokens, as after a real crash)."""
        crash = self.args.crash
        if crash is None or crash.after_tokens is None or tokens < crash.after_tokens:
            return
        self._crash(
            f"RuntimeError: emulated crash after {tokens} streamed tokens "
            "(--emulator-crash-after-tokens)"
        )

    def _crash(self, line: str, entry: dict[str, Any] | None = None) -> None:
        """Exit as SGLang's scheduler does on an exception: a traceback, its last line the
        error, then the parent's notice. With `--emulator-crash-once PATH`, only while PATH
        does not exist: it is created first, so the restarted engine lives on. `entry`: the
        request that kills it, logged (when a log is kept) only when it does."""
        once = self.args.crash.once_path if self.args.crash is not None else None
        if not self._crash_armed:
            return
        if once is not None:
            try:
                with open(once, "x"):
                    pass
            except FileExistsError:
                self._crash_armed = False
                return
        if entry is not None:
            self.log_request(entry)
        log.error("Scheduler hit an exception: Traceback (most recent call last):", extra=TP0)
        sys.stderr.write('  File "emulator/sim/stepper.py", in submit\n' + line + "\n")
        log.error("Received sigquit from a child process. It usually means the child failed.")
        logging.shutdown()
        sys.stderr.flush()
        os._exit(1)

    def check_lengths(self, prompt_tokens: int, max_tokens: int | None) -> int | None:
        """The tokenizer's context checks (§4); returns max_tokens, clipped under auto-truncate."""
        args = self.args
        ctx = args.context_length
        n = prompt_tokens + args.reserved_tokens
        if n >= ctx and not args.allow_auto_truncate:
            raise ApiError(
                400,
                f"The input ({n} tokens) is longer than the model's context length ({ctx} tokens).",
            )
        if max_tokens is not None and max_tokens + n >= ctx:
            if args.allow_auto_truncate:
                return max(0, ctx - n - 1)
            raise ApiError(
                400,
                f"Requested token count exceeds the model's maximum context length of {ctx} "
                f"tokens. You requested a total of {max_tokens + n} tokens: {n} tokens from "
                f"the input messages and {max_tokens} tokens for the completion. Please reduce "
                "the number of tokens in the input messages or the completion to fit within "
                "the limit.",
            )
        return max_tokens

    def plan(
        self,
        prompt_tokens: int,
        seed: int,
        max_tokens: int | None,
        *,
        ignore_eos: bool = False,
        min_tokens: int = 0,
    ) -> Sequence:
        """A sequence with its completion length fixed by the prompt's seed and the caps."""
        caps = [
            self.args.context_length - prompt_tokens - self.args.reserved_tokens - 1,
            self.knobs.max_completion_tokens,
        ]
        if max_tokens is not None:
            caps.append(max_tokens)
        kind = draw_text_kind(seed, self.knobs.loop_rate, self.knobs.legit_repeat_rate)
        looping = kind == "loop"  # a loop never reaches its end: it runs to the cap
        target, reason = plan_length(
            seed, self.knobs.mean_completion_tokens, caps, ignore_eos or looping, min_tokens
        )
        seq = Sequence(
            rid=uuid.uuid4().hex,
            prompt_tokens=prompt_tokens,
            target_tokens=target,
            finish_reason=reason,
            seed=seed,
            arrived_s=self.clock(),
            text_kind=kind,
            prefill_s=self.model.prefill_s(prompt_tokens),
        )
        if looping:
            seq.loop_at, seq.loop_block = draw_loop(seed, target)
        return seq

    def plan_answer(
        self,
        input_ids: list[int],
        max_new: int | None,
        *,
        ignore_eos: bool = False,
        min_new: int = 0,
    ) -> Sequence:
        """A /generate sequence: the prompt is `input_ids` up to the last generation prompt,
        the rest output already drawn (`k` tokens). The answer's plan comes from the prompt
        alone and its caps are counted over the whole answer (`k` + this request's), so a
        continuation writes exactly what the uninterrupted request would have from token `k`
        on, and stops at the same length for the same reason."""
        split = self.family.split(input_ids)
        drawn = split.drawn
        seed = prompt_ids_seed(input_ids[: split.prompt_len])
        caps = [
            self.args.context_length - split.prompt_len - self.args.reserved_tokens - 1,
            self.knobs.max_completion_tokens,
        ]
        if max_new is not None:
            caps.append(drawn + max_new)
        kind = draw_text_kind(seed, self.knobs.loop_rate, self.knobs.legit_repeat_rate)
        looping = kind == "loop"
        total, reason = plan_length(
            seed,
            self.knobs.mean_completion_tokens,
            caps,
            ignore_eos or looping,
            drawn + min_new if min_new > 0 else 0,
        )
        loop_at, loop_block = draw_loop(seed, total) if looping else (0, 0)
        if looping:
            plan = Plan.looping(seed, total, split.start, loop_at, loop_block)
        else:  # reasoning of the uncut answer: one cut short is cut inside it, no </think>
            natural = natural_length(seed, self.knobs.mean_completion_tokens)
            reasoning = max(1, round(REASONING_SHARE * natural))
            plan = Plan(seed, total, split.start, reasoning, kind)
        seq = Sequence(
            rid=uuid.uuid4().hex,
            prompt_tokens=len(input_ids),
            target_tokens=max(0, total - drawn),
            finish_reason=reason,
            seed=seed,
            arrived_s=self.clock(),
            text_kind=kind,
            loop_at=loop_at,
            loop_block=loop_block,
            prefill_s=self.model.prefill_s(len(input_ids)),
        )
        seq.answer = Answer(self.writer, plan, drawn)
        return seq

    def reasoning_tokens(self, seq: Sequence) -> int:
        """Tokens of a thinking completion spent reasoning: 70 % of its uncut length (all of
        it for a loop, which never gets out of its thinking)."""
        if seq.text_kind == "loop":
            return seq.target_tokens
        natural = natural_length(seq.seed, self.knobs.mean_completion_tokens)
        return min(seq.target_tokens, max(1, round(REASONING_SHARE * natural)))

    def submit(self, seqs: list[Sequence], waker: asyncio.Event, stream: bool) -> None:
        """Hand sequences to the scheduler, after the scheduler-side refusals (§4)."""
        limit = self.args.max_req_input_len
        for seq in seqs:
            if seq.prompt_tokens >= limit and not self.args.allow_auto_truncate:
                raise ApiError(
                    400,
                    f"Input length ({seq.prompt_tokens} tokens) exceeds the maximum allowed "
                    f"length ({limit} tokens). Use a shorter input or enable "
                    "--allow-auto-truncate.",
                    stage="scheduler",
                )
        if self.scheduler.queue_full():
            raise queue_full()
        now = self.clock()
        for seq in seqs:
            seq.arrived_s = now
            if self.model.zero_time or seq.target_tokens == 0:
                self.scheduler.complete_now(seq, now)
                if self.scheduler.due_fold():
                    self.scheduler.fold(now)
                continue
            seq.waker = waker
            seq.stream = stream
            seq.stream_every = self.args.stream_interval
            self.scheduler.submit(seq, now)
        self._write_tokens()
        crash = self.args.crash
        if (
            crash is not None
            and crash.at_running
            and len(self.scheduler.running) >= crash.at_running
        ):
            self._crash(crash.line)
        self._work.set()
        self._power_changed(now)

    async def wait(self, seqs: list[Sequence], waker: asyncio.Event) -> None:
        """Return once every sequence finished (non-streaming handlers)."""
        while not all(seq.done for seq in seqs):
            await waker.wait()
            waker.clear()

    def abort(self, seqs: list[Sequence]) -> None:
        """The client went away: free the slots of its unfinished sequences."""
        now = self.clock()
        for seq in seqs:
            self.scheduler.abort(seq, now)
        self._power_changed(now)

    def power_w(self) -> float:
        """Watts now; an adaptive engine that stopped drafting draws what a plain decode does."""
        running = len(self.scheduler.running)
        power = self.power
        spec = self.model.spec
        if spec is not None and spec.adaptive and self.model.steps_for(running) == 0:
            power = replace(power, spec=False)
        return power.power_w(running, self.args.max_running_requests)

    def _power_changed(self, now: float) -> None:
        self.meter.set_power(now, self.power_w())

    async def _loop(self) -> None:
        """Step the batch on a fixed timeline, catching up when the event loop ran late."""
        s = self.scheduler
        clock = self.clock
        next_at = clock()
        while True:
            if not s.running:
                self._work.clear()
                await self._work.wait()
                s.tallies.interval_start_s = clock()  # throughput while busy, not since idle
                next_at = clock() + self.model.step_time_s(len(s.running))
            delay = next_at - clock()
            if delay > 0:
                await asyncio.sleep(delay)
            steps = 0
            while s.running and next_at <= clock() and steps < MAX_CATCH_UP_STEPS:
                self._step(next_at)
                steps += 1
                next_at += self.model.step_time_s(len(s.running))
            self._power_changed(clock())
            if steps >= MAX_CATCH_UP_STEPS:
                await asyncio.sleep(0)

    def _step(self, now: float) -> None:
        s = self.scheduler
        finished = s.step(now)
        self._write_tokens()
        for seq in s.running:  # a stream's chunk once --stream-interval tokens are unsent
            if seq.stream and seq.generated - seq.streamed_at >= seq.stream_every:
                seq.streamed_at = seq.generated
                seq.waker.set()
        for seq in finished:
            seq.waker.set()
        crash = self.args.crash
        if crash is not None and crash.after_tokens is not None and self._crash_armed:
            for seq in (*s.running, *finished):  # streams check after sending (`streamed`)
                if not seq.stream and seq.generated >= crash.after_tokens:
                    self.streamed(seq.generated)
        if s.due_fold():
            s.fold(now)
            self._log_decode(now)

    def _log_decode(self, now: float) -> None:
        """SGLang's periodic "Decode batch" line, at most once a second."""
        if now - self._last_log_s < DECODE_LOG_MIN_INTERVAL_S:
            return
        self._last_log_s = now
        s = self.scheduler
        t = s.tallies
        tokens = sum(seq.prompt_tokens + seq.generated for seq in s.running)
        accept = f"accept len: {t.last_spec_accept_length:.2f}, " if self.args.spec else ""
        log.info(
            "Decode batch, #running-req: %d, #token: %d, token usage: %.2f, %s"
            "cuda graph: True, gen throughput (token/s): %.2f, #queue-req: %d,",
            len(s.running),
            tokens,
            tokens / self.args.max_total_num_tokens,
            accept,
            t.last_gen_throughput,
            len(s.waiting),
            extra=TP0,
        )
