"""The emulator's pure parts as tables: argv resolution, time model, scheduler, power, text."""

from __future__ import annotations

import statistics

import pytest

from genfleet.workers.engine.emulator import (
    EnergyMeter,
    LaunchError,
    PowerModel,
    Scheduler,
    Sequence,
    SpecConfig,
    TimeModel,
    natural_length,
    parse_args,
    plan_length,
)
from genfleet.workers.engine.emulator.sim.text import count_tokens, synth_text

EAGLE = SpecConfig("EAGLE", 3, 1, 4)


def model(spec: SpecConfig | None = None, **kw: float) -> TimeModel:
    params = {"step_base_ms": 12.0, "step_per_request_ms": 0.25, "time_scale": 1.0}
    params |= {"accept_length": 2.6, **kw}
    return TimeModel(spec=spec, **params)


def seq(target: int, rid: str = "r", prompt: int = 10) -> Sequence:
    return Sequence(rid, prompt, target, "stop", seed=1, arrived_s=0.0)


@pytest.mark.parametrize(
    ("argv", "algorithm", "triple", "max_running"),
    [
        ([], None, None, 4096),
        (["--speculative-algo", "NEXTN"], "EAGLE", (3, 1, 4), 48),
        (["--speculative-algorithm", "eagle"], "EAGLE", (3, 1, 4), 48),
        (["--speculative-algorithm", "EAGLE", "--max-running-requests", "256"],
         "EAGLE", (3, 1, 4), 256),
        (["--speculative-algorithm", "EAGLE", "--speculative-num-steps", "5"],
         "EAGLE", (5, 1, 6), 48),
        (
            ["--speculative-algorithm", "EAGLE3", "--speculative-num-steps", "2",
             "--speculative-eagle-topk", "1", "--speculative-num-draft-tokens", "8"],
            "EAGLE3", (2, 1, 3), 48,
        ),
        (["--speculative-algorithm", "NONE"], None, None, 4096),
    ],
)  # fmt: skip
def test_speculative_resolution(
    argv: list[str], algorithm: str | None, triple: tuple[int, int, int] | None, max_running: int
) -> None:
    args = parse_args(["--model-path", "m", *argv])
    assert args.max_running_requests == max_running
    if algorithm is None:
        assert args.spec is None
    else:
        assert args.spec is not None
        spec = args.spec
        assert spec.algorithm == algorithm
        assert (spec.num_steps, spec.eagle_topk, spec.num_draft_tokens) == triple


def test_argv_ignores_gpu_flags_and_takes_prefixes() -> None:
    args = parse_args(
        ["--model", "m", "--tp", "4", "--mamba-radix-cache-strategy", "extra_buffer",
         "--cuda-graph-max-bs", "64", "--port", "1234", "--context-length", "32k"]
    )  # fmt: skip
    assert (args.tp_size, args.port, args.context_length) == (4, 1234, 32768)
    assert args.served_model_name == "m"
    assert args.context_length_given


@pytest.mark.parametrize(
    "argv",
    [
        ["--speculative-algorithm", "MEDUSA"],
        ["--speculative-algorithm", "EAGLE", "--speculative-eagle-topk", "2"],
        ["--speculative-algorithm", "DFLASH"],
    ],
)
def test_launch_errors(argv: list[str]) -> None:
    with pytest.raises(LaunchError):
        parse_args(["--model-path", "m", *argv])


def test_reserved_tokens() -> None:
    assert EAGLE.reserved_tokens == 4
    assert SpecConfig("NGRAM", 1, 10, 12).reserved_tokens == 0


@pytest.mark.parametrize(
    ("spec", "running", "ms"),
    [
        (None, 1, 12.25),
        (None, 48, 24.0),
        (None, 256, 76.0),
        (EAGLE, 1, 12 * 1.35 + 0.25 * 2.4),
        (EAGLE, 48, 12 * 1.35 + 0.25 * 48 * 2.4),
    ],
)
def test_step_time(spec: SpecConfig | None, running: int, ms: float) -> None:
    assert model(spec).step_time_s(running) == pytest.approx(ms / 1000)
    assert model(spec, time_scale=10).step_time_s(running) == pytest.approx(ms / 10_000)


@pytest.mark.parametrize(
    ("concurrency", "mtp_wins"),
    [(1, True), (8, True), (32, True), (64, True), (128, False), (256, False), (512, False)],
)
def test_mtp_wins_low_loses_high_concurrency(concurrency: int, mtp_wins: bool) -> None:
    with_mtp = model(EAGLE).tokens_per_s(concurrency, max_running=48)
    without = model(None).tokens_per_s(concurrency, max_running=4096)
    assert (with_mtp > without) is mtp_wins


@pytest.mark.parametrize(
    ("caps", "ignore_eos", "expected"),
    [
        ([10], False, (10, "length")),
        ([100_000], True, (100_000, "length")),
        ([0], False, (0, "length")),
    ],
)
def test_plan_length_caps(caps: list[int], ignore_eos: bool, expected: tuple[int, str]) -> None:
    assert plan_length(7, 1800, caps, ignore_eos) == expected


def test_completion_lengths_are_deterministic_heavy_tailed_with_the_mean() -> None:
    lengths = [natural_length(seed * 7919 + 13, 1800) for seed in range(4000)]
    assert lengths[:50] == [natural_length(seed * 7919 + 13, 1800) for seed in range(50)]
    assert statistics.fmean(lengths) == pytest.approx(1800, rel=0.1)
    median = statistics.median(lengths)
    assert max(lengths) > 6 * median
    stop = plan_length(3, 40, [100_000])
    assert stop[1] == "stop" and stop[0] == natural_length(3, 40)


def test_scheduler_cap_fifo_and_one_token_steps() -> None:
    s = Scheduler(model(None), max_running=2)
    seqs = [seq(2, "a"), seq(1, "b"), seq(5, "c"), seq(5, "d")]
    for x in seqs:
        s.submit(x, 0.0)
    assert [x.rid for x in s.running] == ["a", "b"]
    assert [x.rid for x in s.waiting] == ["c", "d"]
    assert [x.rid for x in s.step(1.0)] == ["b"]
    assert [x.rid for x in s.running] == ["a", "c"] and seqs[0].generated == 1
    assert [x.rid for x in s.step(2.0)] == ["a"]
    assert [x.rid for x in s.running] == ["c", "d"]
    assert seqs[2].admitted_s == 1.0 and seqs[3].admitted_s == 2.0
    s.abort(seqs[3], 2.5)
    assert [x.rid for x in s.running] == ["c"] and s.tallies.aborted == 1


def test_queue_full_only_with_a_limit() -> None:
    s = Scheduler(model(None), max_running=1, max_queued=1)
    assert not s.queue_full()
    s.submit(seq(5), 0.0)
    assert not s.queue_full()
    s.submit(seq(5), 0.0)
    assert s.queue_full()
    assert not Scheduler(model(None), max_running=1).queue_full()


def test_spec_accept_length_and_fold_cadence() -> None:
    s = Scheduler(model(EAGLE), max_running=48)
    x = seq(10_000)
    s.submit(x, 0.0)
    for i in range(39):
        s.step(float(i))
    assert not s.due_fold() and s.tallies.avg_spec_accept_length is None
    s.step(39.0)
    assert s.due_fold()
    s.fold(40.0)
    for i in range(400):
        s.step(41.0 + i)
    s.fold(441.0)
    assert x.generated / x.verify_ct == pytest.approx(2.6, abs=0.1)
    assert s.tallies.avg_spec_accept_length == pytest.approx(2.6, abs=0.1)
    assert sum(x.histogram) == x.verify_ct and x.histogram[1] and x.histogram[2]


def test_complete_now_accounts_a_whole_generation() -> None:
    s = Scheduler(model(EAGLE, step_base_ms=0, step_per_request_ms=0), max_running=48)
    assert s.model.zero_time
    x = seq(260)
    s.complete_now(x, 1.0)
    assert x.done and x.generated == 260
    assert x.verify_ct == 100 and sum(x.histogram) == 100
    assert s.tallies.requests == 1 and s.tallies.generation_tokens == 260


@pytest.mark.parametrize(("spec", "running"), [(False, 1), (False, 24), (True, 1), (True, 24)])
def test_power_rises_with_occupancy(spec: bool, running: int) -> None:
    p = PowerModel(idle_power_w=80, power_limit_w=700, spec=spec)
    assert p.power_w(0, 48) == 80
    assert p.power_w(running, 48) < p.power_w(running + 1, 48) <= 0.95 * 700
    assert p.power_w(48, 48) == pytest.approx(0.95 * 700)
    assert PowerModel(80, 700, True).power_w(running, 48) > PowerModel(80, 700, False).power_w(
        running, 48
    )


def test_energy_meter_integrates() -> None:
    meter = EnergyMeter(now=0.0, power_w=100.0)
    meter.set_power(2.0, 300.0)
    assert meter.energy_j(3.0) == pytest.approx(100 * 2 + 300 * 1)


@pytest.mark.parametrize("tokens", [0, 1, 7, 4096, 20_000])
def test_synthetic_text_has_the_token_count(tokens: int) -> None:
    text = synth_text(12345, tokens)
    assert count_tokens(text) == tokens
    assert synth_text(12345, tokens + 3).startswith(text)


@pytest.mark.parametrize(
    ("argv", "adaptive"),
    [
        (["--speculative-algorithm", "NEXTN", "--speculative-adaptive"], True),
        (["--speculative-algorithm", "STANDALONE", "--speculative-adaptive"], False),
        (["--speculative-algorithm", "EAGLE", "--speculative-eagle-topk", "4",
          "--speculative-num-steps", "3", "--speculative-adaptive"], False),
    ],
)  # fmt: skip
def test_adaptive_only_where_sglang_keeps_it(argv: list[str], adaptive: bool) -> None:
    spec = parse_args(["--model-path", "m", *argv]).spec
    assert spec is not None and spec.adaptive is adaptive


@pytest.mark.parametrize(
    ("running", "steps", "accept"),
    [(1, 3, 2.6), (31, 3, 2.6), (32, 1, 1.717), (63, 1, 1.717), (64, 0, 1.0), (256, 0, 1.0)],
)
def test_adaptive_steps_follow_the_running_batch(running: int, steps: int, accept: float) -> None:
    adaptive = model(SpecConfig("EAGLE", 3, 1, 4, adaptive=True))
    assert adaptive.steps_for(running) == steps
    assert adaptive.accept_for(running) == pytest.approx(accept, abs=1e-3)
    same_as = model(EAGLE) if steps == 3 else model(None) if steps == 0 else None
    if same_as is not None:  # the full draft below 32 running; a plain decode step from 64
        assert adaptive.step_time_s(running) == pytest.approx(same_as.step_time_s(running))
    else:  # one draft step: cheaper than the full draft, dearer than none
        assert model(None).step_time_s(running) < adaptive.step_time_s(running)
        assert adaptive.step_time_s(running) < model(EAGLE).step_time_s(running)


def test_adaptive_scheduler_draws_the_tier_accept_length() -> None:
    s = Scheduler(model(SpecConfig("EAGLE", 3, 1, 4, adaptive=True)), max_running=64)
    for i in range(64):
        s.submit(Sequence(str(i), 1, 10_000, "length", i, 0.0), 0.0)
    s.step(0.01)
    assert s.tallies.spec_accept_tokens == 64  # 64 running: no drafts, one token each


@pytest.mark.parametrize(("prompt", "first_token_step"), [(100, 1), (8_000, 17), (40_000, 82)])
def test_prefill_costs_the_whole_input(prompt: int, first_token_step: int) -> None:
    """A sequence's first token waits for its input's prefill (a continuation's input is its
    prompt plus the output it carries): 40,000 tokens a second, in decode steps of 12.25 ms."""
    m = model()
    s = Scheduler(m, max_running=8)
    one = seq(5, prompt=prompt)
    one.prefill_s = m.prefill_s(prompt)
    s.submit(one, 0.0)
    step, now = 0, 0.0
    while one.generated == 0:
        step += 1
        now += m.step_time_s(1)
        s.step(now)
    assert step == first_token_step
    assert model(step_base_ms=0.0, step_per_request_ms=0.0).prefill_s(prompt) == 0.0


def test_crash_flags_parse_and_gate() -> None:
    flags = ["--emulator-crash-after-tokens", "40", "--emulator-crash-once", "/tmp/x"]
    args = parse_args(["--model-path", "m", *flags, "--incremental-streaming-output"])
    assert args.crash is not None
    assert (args.crash.after_tokens, args.crash.once_path) == (40, "/tmp/x")
    assert args.incremental_streaming_output
    with pytest.raises(LaunchError):
        parse_args(["--model-path", "m", "--emulator-crash-once", "/tmp/x"])
    with pytest.raises(LaunchError):
        parse_args(["--model-path", "m", "--emulator-crash-after-tokens", "0"])
