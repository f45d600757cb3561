"""The engine plan: which SGLang memory flags fill this card with this model, and why.

A hybrid model (Qwen3.5/3.6, Qwen3-Next: Gated-DeltaNet layers beside full attention) keeps a
recurrent state per running request, 0.143 GiB for the 27B shape, besides its KV cache. SGLang
sizes that state pool from the memory left after the weights and caps running requests at what
it holds: with its default radix strategy (`extra_buffer`, several slots a request) an H100
80 GB runs 12 requests of a 27B (5 with MTP) whatever `--max-running-requests` says, and decode,
memory-bound, runs at a third of what the card gives (bench/RESULTS.md). Bulk generation shares
no prefix worth caching, so the plan turns the radix cache off (one slot a request) and sizes
the cap so that the state of `cap` requests and the KV cache of their prompts and answers both
fit: `cap × (slot + kv_per_token × tokens) ≤ pool`, `tokens` the prompt and three quarters of
the answer (a continuous batch holds requests at every point of their answers). A larger cap
than that starves the KV cache (cap 128 on an H100 left 19.7K KV tokens: 19 requests ran;
cap 88 at 2,048-token answers ran 61 at the median); a smaller one leaves the card idle.

Everything here is pure: a model's shape (from config.json), the card's memory and the run's
expected lengths in; flags, the cap SGLang will enforce and the reasons out. Dense and MoE models
get nothing added: SGLang sizes their KV cache itself and the cap genfleet passes is today's.
What the engine enforces is read back at start (`check`): a plan the engine cut is a finding.

    shape = ModelShape.from_config(json.load(open("/m/Qwen3.6-27B/config.json")))
    plan = make_plan(shape, PlanInputs(memory_gib=card_memory_gib("h100"), answer_tokens=512))
    plan.max_running_requests, plan.argv()   # (98, ['--max-running-requests', '98', ...])
"""

from __future__ import annotations

import math
import shlex
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from genfleet.common.errors import ConfigError
from genfleet.common.settings import Settings

GIB = 1 << 30

# nvidia-smi's memory.total of the cards genfleet's users run (MiB), for `--plan-gpu NAME`:
# the plan printed without the GPU. A number (GiB) names any other card.
CARDS_MIB: dict[str, int] = {
    "a100-40gb": 40960,
    "a100-80gb": 81920,
    "l40s": 46068,
    "h100": 81559,
    "h100-nvl": 95830,
    "h200": 143771,
    "b200": 183359,
}

# SGLang 0.5.15 sizes its pools as `free_before_weights × fraction − resident`, `resident`
# being what is allocated when it profiles (`model_executor/kv_cache_mixin.py`): the weights
# and a little more. Calibrated with the 27B shape on an H100 80 GB: 19.55 GiB of pools at 0.9
# (cap 64 left 170K KV tokens, cap 128 19.7K), 78.7 GiB free before the weights.
CUDA_CONTEXT_GIB = 0.95
RESIDENT_EXTRA_GIB = 0.4
# The fraction of the card SGLang may take for weights and pools when the plan chooses it: the
# 27B shape started and ran with CUDA graphs at 0.9 on an H100 (cap 64 and 128).
PLAN_MEM_FRACTION = 0.9
# The share of the pool the plan fills at its cap: the scheduler admits by an estimate of the
# tokens still to come, and a full KV cache retracts requests (their decode is lost).
KV_HEADROOM = 0.92
# The share of its answer's KV a running request holds on average, as the plan counts it. In a
# continuous batch requests are at every point of their answers (half of one on average once
# lengths differ); a full KV cache makes SGLang retract a request and prefill it again later
# (its drawn tokens kept), which costs a prefill, not its answer. Sizing for whole answers
# (1.0) left the 27B on an H100 16 % slower at 2,048-token answers than a cap a quarter larger
# (bench/RESULTS.md); 0.75 keeps room for a run's first wave, which starts all at once.
ANSWER_KV_SHARE = 0.75
# A KV cache below this share of the plan's is a plan the engine cut (the estimate of the
# weights and the context is good to a few hundred MiB: 1 % of the 27B's pools).
KV_SHORT = 0.9
# Above this the running batch is compute-bound on every card genfleet runs, and SGLang's
# CUDA graphs (captured up to a batch size that follows the card) no longer cover it.
MAX_PLAN_CAP = 256
# Today's cap for everything the plan has nothing to add to (dense, MoE, unknown shapes): with
# speculative decoding and no --max-running-requests SGLang caps the batch at 48.
DEFAULT_MAX_RUNNING_REQUESTS = 256
# Recurrent-state slots per running request with the radix cache off: exactly
# `--max-running-requests` of them, and with speculative decoding one intermediate state per
# draft token besides (`mem_cache/memory_pool.py`, `kv_cache_mixin.handle_max_mamba_cache`).
SLOTS_PER_REQUEST = 1
# What an MTP decode step costs next to a plain one, and the accept length the plan assumes of
# a trained draft: measured on SGLang 0.5.15 (H100, 27B shape: CUDA graphs off for hybrid +
# MTP on the triton backend, 2.5×), estimated elsewhere. `genfleet tune` measures both.
MTP_STEP_COST_NO_GRAPHS = 2.5
MTP_STEP_COST = 1.4
MTP_ACCEPT_ASSUMED = 3.0

_DTYPE_BYTES = {"float32": 4, "float": 4, "bfloat16": 2, "float16": 2, "half": 2, "fp8": 1}


def card_memory_gib(card: str) -> float:
    """The memory of a named card (`h100`, `h200`, …) or of a number of GiB (`"79.6"`)."""
    name = card.strip().lower()
    if name in CARDS_MIB:
        return CARDS_MIB[name] / 1024
    try:
        gib = float(name.removesuffix("gib").removesuffix("gb"))
    except ValueError:
        raise ConfigError(
            f"--plan-gpu {card!r}: not a card genfleet knows ({', '.join(CARDS_MIB)}) nor a "
            "number of GiB"
        ) from None
    if not 1 <= gib <= 4096:
        raise ConfigError(f"--plan-gpu {card!r}: {gib} GiB is not a GPU's memory")
    return gib


@dataclass(frozen=True)
class ModelShape:
    """What the model costs the engine: its weights, a token's KV, a request's state."""

    layers: int
    full_attention_layers: int
    linear_layers: int
    kv_heads: int
    head_dim: int
    weight_bytes: int
    mtp_weight_bytes: int = 0
    mtp_layers: int = 0
    linear_key_heads: int = 0
    linear_value_heads: int = 0
    linear_key_head_dim: int = 0
    linear_value_head_dim: int = 0
    conv_kernel: int = 0
    ssm_dtype_bytes: int = 4
    dtype_bytes: int = 2
    moe: bool = False

    @property
    def hybrid(self) -> bool:
        """Recurrent (linear-attention) layers beside full attention: a state pool."""
        return self.linear_layers > 0

    @property
    def kv_bytes_per_token(self) -> int:
        """K and V of one token over the full-attention layers."""
        return self.full_attention_layers * self.kv_heads * self.head_dim * 2 * self.dtype_bytes

    @property
    def draft_kv_bytes_per_token(self) -> int:
        """K and V of one token over the MTP draft's layers: with MTP on SGLang builds the
        draft a KV cache of as many tokens as the target's, beside it."""
        return self.mtp_layers * self.kv_heads * self.head_dim * 2 * self.dtype_bytes

    @property
    def conv_state_bytes(self) -> int:
        """One request's convolution state over the linear layers."""
        conv_dim = (
            2 * self.linear_key_heads * self.linear_key_head_dim
            + self.linear_value_heads * self.linear_value_head_dim
        )
        return self.linear_layers * conv_dim * max(self.conv_kernel - 1, 0) * self.dtype_bytes

    @property
    def temporal_state_bytes(self) -> int:
        """One request's recurrent (SSM) state over the linear layers."""
        per_layer = (
            self.linear_value_heads
            * self.linear_key_head_dim
            * self.linear_value_head_dim
            * self.ssm_dtype_bytes
        )
        return self.linear_layers * per_layer

    @property
    def state_bytes_per_slot(self) -> int:
        return self.conv_state_bytes + self.temporal_state_bytes

    @classmethod
    def from_config(cls, config: Mapping[str, Any], weight_bytes: int | None = None) -> ModelShape:
        """The shape of a Hugging Face config.json (a multimodal wrapper's `text_config`
        read); `weight_bytes` from the checkpoint's files, else estimated from the config."""
        text = config.get("text_config")
        c: Mapping[str, Any] = {**config, **text} if isinstance(text, Mapping) else config
        layers = _int(c, "num_hidden_layers")
        heads = _int(c, "num_attention_heads")
        hidden = _int(c, "hidden_size")
        kv_heads = int(c.get("num_key_value_heads") or heads)
        head_dim = int(c.get("head_dim") or hidden // heads)
        kinds = c.get("layer_types")
        if isinstance(kinds, Sequence) and len(kinds) == layers:
            linear = sum(1 for kind in kinds if kind == "linear_attention")
        elif c.get("full_attention_interval") and c.get("linear_num_value_heads"):
            linear = layers - layers // int(c["full_attention_interval"])
        else:
            linear = 0
        mtp_layers = int(c.get("mtp_num_hidden_layers") or c.get("num_nextn_predict_layers") or 0)
        ssm = str(c.get("mamba_ssm_dtype") or "float32").removeprefix("torch.")
        dtype = str(c.get("torch_dtype") or c.get("dtype") or "bfloat16").removeprefix("torch.")
        shape = cls(
            layers=layers,
            full_attention_layers=layers - linear,
            linear_layers=linear,
            kv_heads=kv_heads,
            head_dim=head_dim,
            weight_bytes=0,
            mtp_layers=mtp_layers,
            linear_key_heads=int(c.get("linear_num_key_heads") or 0),
            linear_value_heads=int(c.get("linear_num_value_heads") or 0),
            linear_key_head_dim=int(c.get("linear_key_head_dim") or 0),
            linear_value_head_dim=int(c.get("linear_value_head_dim") or 0),
            conv_kernel=int(c.get("linear_conv_kernel_dim") or 0),
            ssm_dtype_bytes=_DTYPE_BYTES.get(ssm, 4),
            dtype_bytes=_DTYPE_BYTES.get(dtype, 2),
            moe=bool(c.get("num_experts") or c.get("n_routed_experts")),
        )
        params, mtp_params = _parameters(c, shape, config.get("vision_config"))
        return replace(
            shape,
            weight_bytes=weight_bytes or params * shape.dtype_bytes,
            mtp_weight_bytes=mtp_params * shape.dtype_bytes,
        )


def _int(config: Mapping[str, Any], key: str) -> int:
    value = config.get(key)
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise ConfigError(f"config.json: {key} is {value!r}, not a positive integer")
    return value


def _parameters(c: Mapping[str, Any], shape: ModelShape, vision: Any) -> tuple[int, int]:
    """(the model's parameters, its MTP layers') from the config: attention, linear
    attention, MLP (or experts), embeddings and a vision tower; close enough to size pools
    when the checkpoint's files cannot be measured (`--load-format dummy`, a hub id)."""
    hidden = int(c["hidden_size"])
    heads = int(c["num_attention_heads"])
    head = shape.head_dim
    attention = hidden * (heads * head * 2 + 2 * shape.kv_heads * head) + heads * head * hidden
    key = shape.linear_key_heads * shape.linear_key_head_dim
    value = shape.linear_value_heads * shape.linear_value_head_dim
    linear = hidden * (2 * key + value) + hidden * value + 2 * hidden * shape.linear_value_heads
    linear += value * hidden
    ffn = int(c.get("intermediate_size") or 4 * hidden)
    experts = int(c.get("num_experts") or c.get("n_routed_experts") or 0)
    if experts:
        ffn = int(c.get("moe_intermediate_size") or ffn) * (
            experts + int(bool(c.get("shared_expert_intermediate_size")))
        )
    mlp = 3 * hidden * ffn
    vocab = int(c.get("vocab_size") or 0)
    embeddings = vocab * hidden * (1 if c.get("tie_word_embeddings") else 2)
    total = (
        shape.full_attention_layers * attention
        + shape.linear_layers * linear
        + shape.layers * mlp
        + embeddings
    )
    if isinstance(vision, Mapping) and vision.get("hidden_size") and vision.get("depth"):
        width = int(vision["hidden_size"])
        inner = int(vision.get("intermediate_size") or 4 * width)
        total += int(vision["depth"]) * (4 * width * width + 2 * width * inner)
    # The draft holds an embedding and a head of its own while SGLang sizes the pools (they
    # are swapped for the target's after: `speculative/eagle_worker_v2.py`).
    mtp = shape.mtp_layers * (attention + mlp + 2 * hidden * hidden) if shape.mtp_layers else 0
    mtp += 2 * vocab * hidden if mtp else 0
    return total, mtp


@dataclass(frozen=True)
class PlanInputs:
    """What the plan is for besides the model: the card, the run's lengths, what the user
    fixed (None: the plan chooses)."""

    memory_gib: float | None
    answer_tokens: int = 2048
    prompt_tokens: int = 256
    tp_size: int = 1
    mtp: bool | None = None  # None: the plan chooses by its estimate
    max_running_requests: int | None = None
    mem_fraction_static: float | None = None
    radix_cache: bool | None = None  # None: off for hybrid models
    speculative_num_draft_tokens: int = 4
    cuda_graphs_with_mtp: bool = True  # False where genfleet's crash workaround turns them off


@dataclass(frozen=True)
class Flag:
    """One engine flag the plan passes, and why."""

    name: str
    value: str | None
    why: str

    def words(self) -> list[str]:
        return [self.name] if self.value is None else [self.name, self.value]


@dataclass(frozen=True)
class EnginePlan:
    """The flags for one model × card × run, the pool SGLang will build from them and the
    cap it will enforce. `planned`: False where the plan had nothing to add (today's argv)."""

    planned: bool
    max_running_requests: int
    mtp: bool
    flags: tuple[Flag, ...] = ()
    state_slots: int | None = None
    kv_tokens: int | None = None
    pool_gib: float | None = None
    tokens_per_request: int | None = None
    estimate: Mapping[str, float] = field(default_factory=dict)
    notes: tuple[str, ...] = ()

    def argv(self) -> list[str]:
        return [word for flag in self.flags for word in flag.words()]

    @property
    def fix(self) -> str:
        """The flags that reach this plan, as a person would type them."""
        return " ".join(self.argv()) or f"--max-running-requests {self.max_running_requests}"

    def describe(self) -> str:
        """Comment lines: each flag and why, the pool, the estimate, the notes."""
        lines = [
            f"# engine plan: {flag.name} {flag.value or ''}".rstrip() + f": {flag.why}"
            for flag in self.flags
        ]
        if self.planned and self.kv_tokens is not None:
            lines.append(
                f"# engine plan: {self.pool_gib:.1f} GiB of pools = {self.state_slots} state "
                f"slots + {self.kv_tokens:,} KV tokens ({self.tokens_per_request:,} a request)"
            )
        lines += [f"# engine plan: {note}" for note in self.notes]
        return "\n".join(lines)

    def to_json(self) -> dict[str, Any]:
        return {
            "planned": self.planned,
            "max_running_requests": self.max_running_requests,
            "mtp": self.mtp,
            "argv": self.argv(),
            "state_slots": self.state_slots,
            "kv_tokens": self.kv_tokens,
            "pool_gib": round(self.pool_gib, 2) if self.pool_gib is not None else None,
            "estimate": dict(self.estimate),
            "notes": list(self.notes),
        }


def unplanned(inputs: PlanInputs, mtp: bool, why: str) -> EnginePlan:
    """Today's argv: the configured cap (or 256), nothing else added."""
    cap = inputs.max_running_requests or DEFAULT_MAX_RUNNING_REQUESTS
    return EnginePlan(False, cap, mtp, notes=(why,))


def _share_and_resident(shape: ModelShape, inputs: PlanInputs, mtp: bool) -> tuple[float, float]:
    """What `--mem-fraction-static` is a share of on one card (its memory less the context)
    and what that share holds besides the pools (this card's part of the weights, and what
    SGLang has allocated when it profiles)."""
    assert inputs.memory_gib is not None
    weights = shape.weight_bytes + (shape.mtp_weight_bytes if mtp else 0)
    free = (inputs.memory_gib - CUDA_CONTEXT_GIB) * GIB
    return free, weights / inputs.tp_size + RESIDENT_EXTRA_GIB * GIB


def pool_bytes(shape: ModelShape, inputs: PlanInputs, mtp: bool) -> float:
    """What SGLang has for the state and KV pools on one card: its share of the card less the
    weights (this card's part of them) and the context."""
    free, resident = _share_and_resident(shape, inputs, mtp)
    return free * (inputs.mem_fraction_static or PLAN_MEM_FRACTION) - resident


def kv_bytes_per_token(shape: ModelShape, mtp: bool) -> int:
    """What a KV token costs the card: the target's layers, and the draft's with MTP."""
    return shape.kv_bytes_per_token + (shape.draft_kv_bytes_per_token if mtp else 0)


def request_bytes(shape: ModelShape, inputs: PlanInputs, mtp: bool) -> float:
    """What one running request holds on one card: its state slots and the KV of its prompt
    and, on average over a continuous batch, its answer (the draft's KV too with MTP)."""
    slots = SLOTS_PER_REQUEST + (inputs.speculative_num_draft_tokens if mtp else 0)
    tokens = inputs.prompt_tokens + ANSWER_KV_SHARE * inputs.answer_tokens
    kv = kv_bytes_per_token(shape, mtp) * tokens
    return (slots * shape.state_bytes_per_slot + kv) / inputs.tp_size


def fitting_cap(shape: ModelShape, inputs: PlanInputs, mtp: bool) -> int:
    """The most running requests whose state and KV fit the pool (with headroom)."""
    pool = pool_bytes(shape, inputs, mtp)
    return max(
        0, min(MAX_PLAN_CAP, math.floor(pool * KV_HEADROOM / request_bytes(shape, inputs, mtp)))
    )


def decode_rate(shape: ModelShape, inputs: PlanInputs, cap: int, mtp: bool) -> float:
    """Relative decode throughput at `cap` running requests (tokens per weight-read of the
    card): memory-bound decode reads the weights once a step, and each request's state (read
    and written) and half its context's KV on average. An MTP step costs more and yields the
    accept length it assumes."""
    tokens = inputs.prompt_tokens + inputs.answer_tokens / 2
    step = shape.weight_bytes + cap * (
        2 * shape.state_bytes_per_slot + shape.kv_bytes_per_token * tokens
    )
    rate = cap * shape.weight_bytes / step
    if not mtp:
        return rate
    cost = MTP_STEP_COST if inputs.cuda_graphs_with_mtp else MTP_STEP_COST_NO_GRAPHS
    return rate * MTP_ACCEPT_ASSUMED / cost


def make_plan(shape: ModelShape | None, inputs: PlanInputs) -> EnginePlan:
    """The plan for `shape` on a card of `inputs.memory_gib`; ConfigError where the model
    cannot run one request on it (the engine would refuse to start)."""
    default_mtp = True if inputs.mtp is None else inputs.mtp
    if shape is None:
        return unplanned(inputs, default_mtp, "no config.json to plan from: today's argv")
    if not shape.hybrid:
        kind = "MoE" if shape.moe else "dense"
        return unplanned(inputs, default_mtp, f"{kind} model: SGLang sizes its KV cache itself")
    if inputs.memory_gib is None:
        return unplanned(
            inputs, default_mtp, "the card's memory is unknown (no GPU seen, no --plan-gpu)"
        )
    if inputs.radix_cache:
        return unplanned(
            inputs,
            default_mtp,
            "the radix cache is kept (a --mamba-cache-strategy given): "
            "SGLang caps running requests by its state/KV split",
        )
    choices = [inputs.mtp] if inputs.mtp is not None else [False, True]
    caps = {mtp: fitting_cap(shape, inputs, mtp) for mtp in choices}
    fits = [mtp for mtp in choices if caps[mtp] >= 1]
    if not fits:
        need = request_bytes(shape, inputs, choices[0]) / GIB
        have = pool_bytes(shape, inputs, choices[0]) / GIB
        raise ConfigError(
            f"the model does not fit this card: {have:.1f} GiB left for its pools after the "
            f"weights, one request of {inputs.prompt_tokens + inputs.answer_tokens} tokens "
            f"needs {need:.2f} GiB: use more GPUs (--tp-size), a larger card or shorter answers"
        )
    estimate = {
        ("mtp_on" if mtp else "mtp_off"): round(decode_rate(shape, inputs, caps[mtp], mtp), 1)
        for mtp in fits
    }
    mtp = max(fits, key=lambda m: estimate["mtp_on" if m else "mtp_off"])
    return _hybrid_plan(shape, inputs, mtp, caps[mtp], estimate)


def _hybrid_plan(
    shape: ModelShape,
    inputs: PlanInputs,
    mtp: bool,
    cap: int,
    estimate: dict[str, float],
) -> EnginePlan:
    notes: list[str] = []
    flags: list[Flag] = []
    fraction = inputs.mem_fraction_static or PLAN_MEM_FRACTION
    tokens = round(inputs.prompt_tokens + ANSWER_KV_SHARE * inputs.answer_tokens)
    if inputs.max_running_requests is not None:
        if inputs.max_running_requests > cap:
            notes.append(
                f"--max-running-requests {inputs.max_running_requests} is yours; the plan "
                f"would pass {cap}: SGLang will cut it or starve the KV cache"
            )
        cap = inputs.max_running_requests
        cap_why = "yours"
    else:
        cap_why = (
            f"the most requests whose recurrent state ({shape.state_bytes_per_slot / GIB:.3f} "
            f"GiB a slot) and KV of {tokens:,} tokens (the prompt and "
            f"{ANSWER_KV_SHARE:g} of a {inputs.answer_tokens:,}-token answer) fit the pool"
        )
    flags.append(Flag("--max-running-requests", str(cap), cap_why))
    pool = pool_bytes(shape, inputs, mtp)
    slots = cap * (SLOTS_PER_REQUEST + (inputs.speculative_num_draft_tokens if mtp else 0))
    state = slots * shape.state_bytes_per_slot / inputs.tp_size
    kv_tokens = max(0, int((pool - state) / (kv_bytes_per_token(shape, mtp) / inputs.tp_size)))
    draft = kv_tokens * shape.draft_kv_bytes_per_token / inputs.tp_size if mtp else 0.0
    if inputs.mem_fraction_static is None:
        if draft > 0:
            fraction = _fraction_beside_the_draft(shape, inputs, mtp, pool - draft)
            why = (
                f"weights and the target's pools; the draft's KV cache ({draft / GIB:.1f} GiB, "
                "which SGLang builds after them, outside this share) and activations in the rest"
            )
        else:
            why = "weights and pools; the rest for activations and CUDA graphs"
        flags.append(Flag("--mem-fraction-static", f"{fraction:g}", why))
    elif draft > 0:
        notes.append(
            f"the draft's KV cache ({draft / GIB:.1f} GiB) comes beside "
            f"--mem-fraction-static {fraction:g}'s share: leave it room"
        )
    if inputs.radix_cache is None:
        flags.append(
            Flag(
                "--disable-radix-cache",
                None,
                "bulk prompts share no prefix worth caching; "
                "the radix cache's extra state slots would cut the cap",
            )
        )
    if inputs.mtp is None:
        other = estimate.get("mtp_on" if not mtp else "mtp_off")
        if other is None:
            notes.append(f"MTP {'on' if mtp else 'off'}: the other choice does not fit")
        else:
            notes.append(
                f"MTP {'on' if mtp else 'off'} by the plan's estimate ({estimate}; relative "
                f"decode rates, MTP assumed to accept {MTP_ACCEPT_ASSUMED:g}): measure with "
                "`genfleet tune`, or choose with --mtp / --no-mtp"
            )
    return EnginePlan(
        planned=True,
        max_running_requests=cap,
        mtp=mtp,
        flags=tuple(flags),
        state_slots=slots,
        kv_tokens=kv_tokens,
        pool_gib=pool / GIB,
        tokens_per_request=tokens,
        estimate=estimate,
        notes=(f"for {fraction:g} of {inputs.memory_gib:.1f} GiB", *notes),
    )


def _fraction_beside_the_draft(
    shape: ModelShape, inputs: PlanInputs, mtp: bool, target_pool: float
) -> float:
    """The `--mem-fraction-static` whose pools are `target_pool` (the inverse of
    `pool_bytes`), rounded down: SGLang 0.5.15 fills its share with the target's pools and
    then allocates the draft's KV cache, as many tokens again, beyond it (a 118M-parameter
    hybrid with MTP at 0.9 on an H100: 70.3 GiB of target pools, then 33 GiB more asked for
    the draft, out of memory)."""
    free, resident = _share_and_resident(shape, inputs, mtp)
    return math.floor(1000 * (target_pool + resident) / free) / 1000


def check(plan: EnginePlan, info: Mapping[str, Any], enforced: int | None) -> str | None:
    """What the engine's /server_info says against the plan: None when it runs the plan's cap
    with the KV cache it planned (or the plan had nothing to say), else why not — a finding,
    never silence. `enforced`: the cap the engine enforces (`engine_state.enforced_cap`)."""
    if not plan.planned or enforced is None:
        return None
    kv = info.get("max_total_num_tokens")
    kv_short = isinstance(kv, int) and plan.kv_tokens is not None and kv < KV_SHORT * plan.kv_tokens
    if enforced >= plan.max_running_requests and not kv_short:
        return None
    kv_text = f" and {kv:,} KV tokens" if isinstance(kv, int) else ""
    return (
        f"the engine runs {enforced} requests at a time{kv_text}; the plan expected "
        f"{plan.max_running_requests} and {plan.kv_tokens or 0:,}: its pools are smaller than "
        "planned (another process on the GPU, other weights, other flags): pass "
        "--max-running-requests or --mem-fraction-static yourself, or run `genfleet tune`"
    )


def inputs_of(settings: Settings, memory_gib: float | None, mtp_graphs: bool = True) -> PlanInputs:
    """The plan's inputs from a worker's settings: what the user set is kept, the rest is the
    plan's to choose. `mtp_graphs`: False where genfleet turns CUDA graphs off for MTP."""
    extra = shlex.split(settings.engine_extra_args)
    given = settings.model_fields_set
    radix: bool | None = None
    if "--disable-radix-cache" in extra:
        radix = False
    elif settings.mamba_cache_strategy is not None:
        radix = True  # a radix strategy chosen: the cache stays on
    return PlanInputs(
        memory_gib=memory_gib,
        answer_tokens=settings.plan_answer_tokens or settings.max_tokens,
        prompt_tokens=settings.plan_prompt_tokens,
        tp_size=settings.tp_size,
        mtp=settings.mtp if "mtp" in given else None,
        max_running_requests=settings.max_running_requests,
        mem_fraction_static=settings.mem_fraction_static,
        radix_cache=radix,
        speculative_num_draft_tokens=settings.speculative_num_draft_tokens,
        cuda_graphs_with_mtp=mtp_graphs,
    )
