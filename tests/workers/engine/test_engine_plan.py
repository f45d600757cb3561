"""The engine plan (workers/engine/plan.py): model × card × run → SGLang's cap and memory flags.

Configs are the published ones (Qwen3.5/3.6-27B, Qwen3-Next-80B-A3B, Qwen3-8B, Qwen3-30B-A3B);
the 27B's figures are checked against what SGLang 0.5.15 built on an H100 80 GB
(bench/RESULTS.md): 170K KV tokens at cap 64 and 19.7K at cap 128 with the radix cache off,
19.55 GiB of pools at --mem-fraction-static 0.9.
"""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from genfleet.common.errors import ConfigError
from genfleet.common.settings import Settings
from genfleet.workers.engine import local
from genfleet.workers.engine.kinds import engine_launch, planned, print_engine_command
from genfleet.workers.engine.plan import (
    ANSWER_KV_SHARE,
    CUDA_CONTEXT_GIB,
    GIB,
    KV_HEADROOM,
    PLAN_MEM_FRACTION,
    RESIDENT_EXTRA_GIB,
    ModelShape,
    PlanInputs,
    card_memory_gib,
    check,
    inputs_of,
    make_plan,
    pool_bytes,
    request_bytes,
)
from tests.support.model_configs import QWEN35, qwen35_27b, qwen35_toy


def qwen3_next_80b() -> dict[str, Any]:
    return {
        "architectures": ["Qwen3NextForCausalLM"],
        "hidden_size": 2048,
        "num_hidden_layers": 48,
        "full_attention_interval": 4,
        "num_attention_heads": 16,
        "num_key_value_heads": 2,
        "head_dim": 256,
        "linear_num_key_heads": 16,
        "linear_num_value_heads": 32,
        "linear_key_head_dim": 128,
        "linear_value_head_dim": 128,
        "linear_conv_kernel_dim": 4,
        "num_experts": 512,
        "moe_intermediate_size": 512,
        "shared_expert_intermediate_size": 512,
        "intermediate_size": 5120,
        "vocab_size": 151936,
        "torch_dtype": "bfloat16",
    }


def qwen3_8b() -> dict[str, Any]:
    return {
        "architectures": ["Qwen3ForCausalLM"],
        "hidden_size": 4096,
        "num_hidden_layers": 36,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "head_dim": 128,
        "intermediate_size": 12288,
        "vocab_size": 151936,
        "torch_dtype": "bfloat16",
    }


def qwen3_30b_a3b() -> dict[str, Any]:
    return {
        "architectures": ["Qwen3MoeForCausalLM"],
        "hidden_size": 2048,
        "num_hidden_layers": 48,
        "num_attention_heads": 32,
        "num_key_value_heads": 4,
        "head_dim": 128,
        "num_experts": 128,
        "moe_intermediate_size": 768,
        "intermediate_size": 6144,
        "vocab_size": 151936,
        "torch_dtype": "bfloat16",
    }


SHAPE_27B = ModelShape.from_config(qwen35_27b())


def test_the_27b_shape_is_what_sglang_allocates() -> None:
    # SGLang 0.5.15: conv state (10240 × 3, bf16) + temporal state (48 × 128 × 128, fp32) a
    # linear layer, 48 of them; K and V of 4 heads × 256 over 16 full-attention layers.
    assert SHAPE_27B.state_bytes_per_slot == 153_944_064
    assert SHAPE_27B.kv_bytes_per_token == 65_536
    assert (SHAPE_27B.linear_layers, SHAPE_27B.full_attention_layers) == (48, 16)
    assert 50 * GIB < SHAPE_27B.weight_bytes < 52 * GIB  # 51 GiB loaded on the card


@pytest.mark.parametrize(
    ("cap", "measured_kv_tokens"),
    [(64, 170_000), (128, 19_700)],
)
def test_the_pool_matches_what_sglang_built_on_an_h100(cap: int, measured_kv_tokens: int) -> None:
    inputs = PlanInputs(card_memory_gib("h100"), 512, mtp=False, max_running_requests=cap)
    plan = make_plan(SHAPE_27B, inputs)
    assert plan.kv_tokens == pytest.approx(measured_kv_tokens, rel=0.03)
    assert plan.pool_gib == pytest.approx(19.55, abs=0.1)


# model × card × run → (cap, MTP, flags present); None: ConfigError (does not fit).
PLANS: list[tuple[str, Any, PlanInputs, int | None, int | None, bool | None, list[str]]] = [
    # name, config, inputs, least cap, most cap, MTP chosen, flags
    (
        "27B h100 512",
        qwen35_27b,
        PlanInputs(card_memory_gib("h100"), 512),
        85,
        110,
        False,
        ["--disable-radix-cache", "--mem-fraction-static"],
    ),
    (
        "27B h100 2048",
        qwen35_27b,
        PlanInputs(card_memory_gib("h100"), 2048),
        65,
        80,
        False,
        ["--disable-radix-cache"],
    ),
    ("27B h100 8192", qwen35_27b, PlanInputs(card_memory_gib("h100"), 8192), 26, 40, False, []),
    (
        "27B h100 MTP on",
        qwen35_27b,
        PlanInputs(card_memory_gib("h100"), 512, mtp=True),
        10,
        20,
        True,
        ["--disable-radix-cache"],
    ),
    ("27B h200 2048", qwen35_27b, PlanInputs(card_memory_gib("h200"), 2048), 70, 256, None, []),
    (
        "27B h100 tp2",
        qwen35_27b,
        PlanInputs(card_memory_gib("h100"), 2048, tp_size=2, mtp=False),
        120,
        256,
        False,
        [],
    ),
    (
        "27B a100-40gb",
        qwen35_27b,
        PlanInputs(card_memory_gib("a100-40gb"), 512),
        None,
        None,
        None,
        [],
    ),
    (
        "Next-80B h200",
        qwen3_next_80b,
        PlanInputs(card_memory_gib("h200"), 2048),
        None,
        None,
        None,
        [],
    ),
    (
        "Next-80B h100 tp4",
        qwen3_next_80b,
        PlanInputs(80, 2048, tp_size=4),
        100,
        256,
        None,
        ["--disable-radix-cache"],
    ),
]


@pytest.mark.parametrize(
    ("config", "inputs", "least", "most", "mtp", "flags"),
    [row[1:] for row in PLANS],
    ids=[row[0] for row in PLANS],
)
def test_plan_table(
    config: Any,
    inputs: PlanInputs,
    least: int | None,
    most: int | None,
    mtp: bool | None,
    flags: list[str],
) -> None:
    shape = ModelShape.from_config(config())
    if least is None:
        with pytest.raises(ConfigError, match="does not fit"):
            make_plan(shape, inputs)
        return
    assert most is not None
    plan = make_plan(shape, inputs)
    assert plan.planned and least <= plan.max_running_requests <= most
    assert plan.max_running_requests != 256 or most == 256
    if mtp is not None:
        assert plan.mtp is mtp
    argv = plan.argv()
    assert argv[argv.index("--max-running-requests") + 1] == str(plan.max_running_requests)
    assert all(flag in argv for flag in flags)
    # What it plans fits: every running request's state and KV within the pool.
    used = plan.max_running_requests * request_bytes(shape, inputs, plan.mtp)
    assert used <= pool_bytes(shape, inputs, plan.mtp) * KV_HEADROOM
    assert plan.kv_tokens is not None
    # ... the KV of every prompt and three quarters of every answer (a continuous batch
    # holds requests at every point of their answers), never less than one whole answer.
    assert plan.kv_tokens >= plan.max_running_requests * (
        inputs.prompt_tokens + ANSWER_KV_SHARE * inputs.answer_tokens
    )
    assert plan.kv_tokens >= inputs.prompt_tokens + inputs.answer_tokens


@pytest.mark.parametrize(
    ("config", "why"),
    [(qwen3_8b, "dense model"), (qwen3_30b_a3b, "MoE model")],
)
def test_dense_and_moe_models_keep_todays_argv(config: Any, why: str) -> None:
    plan = make_plan(ModelShape.from_config(config()), PlanInputs(card_memory_gib("h100"), 2048))
    assert not plan.planned and plan.max_running_requests == 256 and plan.argv() == []
    assert why in plan.notes[0]


def test_a_plan_without_the_cards_memory_says_so() -> None:
    plan = make_plan(SHAPE_27B, PlanInputs(None, 512))
    assert not plan.planned and "memory is unknown" in plan.notes[0]


def test_what_the_user_set_is_kept() -> None:
    inputs = PlanInputs(
        card_memory_gib("h100"), 512, mtp=False, max_running_requests=200, mem_fraction_static=0.85
    )
    plan = make_plan(SHAPE_27B, inputs)
    assert plan.max_running_requests == 200
    assert "--mem-fraction-static" not in plan.argv()  # the worker passes the user's
    assert any("would pass" in note for note in plan.notes)
    kept = make_plan(SHAPE_27B, PlanInputs(card_memory_gib("h100"), 512, radix_cache=True))
    assert not kept.planned


def test_the_mtp_choice_is_the_estimate_said_aloud() -> None:
    plan = make_plan(SHAPE_27B, PlanInputs(card_memory_gib("h100"), 512))
    assert set(plan.estimate) == {"mtp_on", "mtp_off"}
    assert plan.mtp is (plan.estimate["mtp_on"] > plan.estimate["mtp_off"])
    assert any("genfleet tune" in note for note in plan.notes)


def test_card_names_and_numbers() -> None:
    assert card_memory_gib("H100") == pytest.approx(79.65, abs=0.01)
    assert card_memory_gib("141") == 141.0
    assert card_memory_gib("h200") > card_memory_gib("h100")
    with pytest.raises(ConfigError, match="--plan-gpu"):
        card_memory_gib("rtx-banana")


def test_check_makes_a_cut_plan_a_finding() -> None:
    plan = make_plan(SHAPE_27B, PlanInputs(card_memory_gib("h100"), 512))
    assert plan.kv_tokens is not None
    cap = plan.max_running_requests
    assert check(plan, {"max_total_num_tokens": plan.kv_tokens}, cap) is None
    cut = check(plan, {"max_total_num_tokens": plan.kv_tokens}, 12)
    assert cut is not None and f"expected {cap}" in cut
    short = check(plan, {"max_total_num_tokens": plan.kv_tokens // 2}, cap)
    assert short is not None
    unplanned = make_plan(SHAPE_27B, PlanInputs(None, 512))
    assert check(unplanned, {}, 1) is None


@pytest.fixture
def checkpoint_27b(tmp_path: Path) -> Path:
    (tmp_path / "config.json").write_text(json.dumps(qwen35_27b()))
    return tmp_path


def test_the_worker_launches_the_plan(checkpoint_27b: Path) -> None:
    settings = Settings(
        engine="sglang",
        model=str(checkpoint_27b),
        plan_gpu="h100",
        max_tokens=512,
        sglang_version="0.5.15",
    )
    chosen, plan = planned(settings, QWEN35)
    assert plan is not None and plan.planned and chosen.mtp is plan.mtp is False
    launch = engine_launch(chosen, 30001, QWEN35, plan)
    assert launch is not None
    argv = launch.argv
    assert argv.count("--max-running-requests") == 1
    assert argv[argv.index("--max-running-requests") + 1] == str(plan.max_running_requests)
    assert "--disable-radix-cache" in argv and "--speculative-algorithm" not in argv
    assert "--mamba-radix-cache-strategy" not in argv


def test_an_mtp_given_is_kept_and_no_radix_strategy_without_radix(checkpoint_27b: Path) -> None:
    settings = Settings(
        engine="sglang",
        model=str(checkpoint_27b),
        plan_gpu="h100",
        max_tokens=512,
        mtp=True,
        sglang_version="0.5.15",
    )
    chosen, plan = planned(settings, QWEN35)
    assert plan is not None and plan.mtp and chosen.mtp
    launch = engine_launch(chosen, 30001, QWEN35, plan)
    assert launch is not None
    assert "--speculative-algorithm" in launch.argv
    assert "--mamba-radix-cache-strategy" not in launch.argv


def test_no_engine_plan_is_todays_argv(checkpoint_27b: Path) -> None:
    settings = Settings(
        engine="sglang",
        model=str(checkpoint_27b),
        plan_gpu="h100",
        engine_plan=False,
        sglang_version="0.5.15",
    )
    chosen, plan = planned(settings, QWEN35)
    assert plan is None and chosen is settings
    launch = engine_launch(chosen, 30001, QWEN35, plan)
    assert launch is not None
    argv = launch.argv
    assert argv[argv.index("--max-running-requests") + 1] == "256"


def test_the_plan_prints_without_a_gpu(checkpoint_27b: Path) -> None:
    text = print_engine_command(
        Settings(
            engine="sglang",
            model=str(checkpoint_27b),
            plan_gpu="h100",
            max_tokens=2048,
            sglang_version="0.5.15",
        )
    )
    command = text.splitlines()[0] if "sglang" in text.splitlines()[0] else text
    assert "--max-running-requests 256" not in command
    assert "--disable-radix-cache" in text
    assert "# engine plan: --max-running-requests" in text
    assert "KV tokens" in text


def test_settings_reach_the_plan(checkpoint_27b: Path) -> None:
    settings = Settings(
        model=str(checkpoint_27b),
        max_tokens=4096,
        plan_answer_tokens=1000,
        plan_prompt_tokens=100,
        tp_size=2,
    )
    inputs = inputs_of(settings, 80.0)
    assert (inputs.answer_tokens, inputs.prompt_tokens, inputs.tp_size) == (1000, 100, 2)
    assert inputs.mtp is None  # not given: the plan's to choose
    assert inputs_of(Settings(mtp=False), 80.0).mtp is False
    extra = Settings(engine_extra_args="--disable-radix-cache")
    assert inputs_of(extra, 80.0).radix_cache is False


def test_a_plan_the_engine_would_refuse_is_caught_before_launch(checkpoint_27b: Path) -> None:
    settings = Settings(
        engine="sglang", model=str(checkpoint_27b), plan_gpu="a100-40gb", sglang_version="0.5.15"
    )
    with pytest.raises(ConfigError, match="does not fit this card"):
        print_engine_command(settings)


def test_a_radix_cache_turned_off_in_extra_args_gets_no_radix_strategy(
    checkpoint_27b: Path,
) -> None:
    settings = Settings(
        engine="sglang", model=str(checkpoint_27b), mtp=True, engine_plan=False,
        engine_extra_args="--disable-radix-cache", sglang_version="0.5.15",
    )  # fmt: skip
    launch = engine_launch(settings, 30001, QWEN35)
    assert launch is not None
    assert launch.argv.count("--disable-radix-cache") == 1
    assert "--mamba-radix-cache-strategy" not in launch.argv


@pytest.mark.parametrize(
    ("updates", "judged"),
    [
        ({}, True),  # the 27B's checkpoint on an H100: the plan SGLang would be launched with
        ({"engine_plan": False}, False),  # --no-engine-plan: no plan to judge it by
        ({"model": "Qwen/Qwen3.6-27B"}, False),  # a hub id: no config to plan from
    ],
)
def test_an_external_engine_is_judged_against_the_plan(
    checkpoint_27b: Path, updates: dict[str, Any], judged: bool
) -> None:
    """The old default on an H100 ran 12 of a plan of 98: without the plan beside it, the
    power-watch could not say so, nor give the plan's flags as the fix."""
    settings = Settings(
        engine="external",
        engine_url="http://127.0.0.1:30000",
        model=str(checkpoint_27b),
        plan_gpu="h100",
        max_tokens=512,
        sglang_version="0.5.15",
    ).model_copy(update=updates)
    hooks = local.Hooks(lambda: None, lambda _: None, lambda: None)
    made = local.make(settings, "gpu0@test", hooks)
    assert made.plan is None  # nothing was launched by a plan
    if not judged:
        assert made.reference is None
        return
    as_sglang = settings.model_copy(update={"engine": "sglang"})
    _, plan = planned(as_sglang, QWEN35)
    assert plan is not None and made.reference is not None
    assert made.reference.max_running_requests == plan.max_running_requests
    assert 12 < made.reference.max_running_requests < 256
    assert "--disable-radix-cache" in made.reference.fix


@pytest.mark.parametrize("mtp", [True, False])
def test_the_draft_s_kv_cache_fits_beside_the_target_s(mtp: bool) -> None:
    """Measured on an H100 (SGLang 0.5.15): the 118M-parameter hybrid with MTP at 0.9 built
    70.3 GiB of target pools (as planned), then asked 33 GiB more for the draft's KV cache of
    as many tokens, with 7.7 GiB free: out of memory. The plan leaves the draft its room."""
    shape = ModelShape.from_config(qwen35_toy())
    assert shape.draft_kv_bytes_per_token == shape.kv_bytes_per_token // 2  # 1 layer of 2
    inputs = PlanInputs(memory_gib=card_memory_gib("h100"), answer_tokens=768, mtp=mtp)
    plan = make_plan(shape, inputs)
    assert plan.planned and plan.mtp is mtp and plan.max_running_requests == 256
    argv = plan.argv()
    fraction = float(argv[argv.index("--mem-fraction-static") + 1])
    assert plan.state_slots is not None and plan.kv_tokens is not None
    target = (
        plan.state_slots * shape.state_bytes_per_slot + plan.kv_tokens * shape.kv_bytes_per_token
    )
    draft = plan.kv_tokens * shape.draft_kv_bytes_per_token if mtp else 0
    weights = shape.weight_bytes + (shape.mtp_weight_bytes if mtp else 0)
    free = (inputs.memory_gib - CUDA_CONTEXT_GIB) * GIB  # type: ignore[operator]
    # Everything SGLang allocates fits the plan's share of the card, the draft's cache too ...
    assert target + draft + weights + RESIDENT_EXTRA_GIB * GIB <= PLAN_MEM_FRACTION * free
    # ... and the share passed is the one whose pools SGLang sizes to the target's alone.
    built = pool_bytes(shape, replace(inputs, mem_fraction_static=fraction), mtp)
    assert abs(built - target) < 0.01 * target
    assert (fraction < 0.75) if mtp else (fraction == PLAN_MEM_FRACTION)
