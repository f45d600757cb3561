"""SGLang's launch flags as the emulator reads them, resolved the way SGLang resolves them.

The emulator is started from the very argv the supervisor builds for SGLang, so the parser
accepts every SGLang flag: the ones that change what the emulator reports or how it behaves
are parsed (with `allow_abbrev=True`, so `--tp 2` and `--speculative-algo NEXTN` work), and
everything else (GPU-only flags, parsers, unknown flags) is left aside by `parse_known_args`.
Speculative defaults follow `arg_groups/speculative_hook.py` (see sglang-contract.md §1.2).

A few flags are the emulator's own, for fault tests, passed with `--engine-extra-args` (real
SGLang refuses them): it dies the way an engine does, its last log line an error:

    --emulator-crash-at-running 8 --emulator-crash-line "RuntimeError: ..."   # at a load level
    --emulator-crash-on-prompt POISON     # on a generation request whose prompt holds it (chat
                                          # messages; /generate text, or its ids decoded)
    --emulator-crash-after-tokens 40      # once a sequence has streamed 40 output tokens
    --emulator-crash-once /tmp/crashed    # any of the above only while that file does not
                                          # exist (created first): a restarted engine lives
"""

from __future__ import annotations

import argparse
import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

DEFAULT_CONTEXT_LENGTH = 32768
AUTO_MAX_RUNNING_REQUESTS = 4096  # SGLang's auto value on a large GPU (contract §8.1)
SPEC_MAX_RUNNING_REQUESTS = 48
KV_POOL_TOKENS_PER_GPU = 1_048_576
DEFAULT_MEM_FRACTION_STATIC = 0.88
DEFAULT_ARCHITECTURE = "EmulatedForCausalLM"

SPEC_ALGORITHMS = {"DFLASH", "DSPARK", "EAGLE", "EAGLE3", "FROZEN_KV_MTP", "STANDALONE", "NGRAM"}
EAGLE_FAMILY = {"EAGLE", "EAGLE3", "STANDALONE", "FROZEN_KV_MTP", "DSPARK"}
RESERVING_ALGORITHMS = {"EAGLE", "EAGLE3", "FROZEN_KV_MTP"}
WIDE_DRAFT_ARCHS = {"LlamaForCausalLM", "Grok1ForCausalLM"}
SELF_DRAFT_ARCH_PREFIXES = (
    "DeepseekV2",
    "DeepseekV3",
    "DeepseekV32",
    "Glm4Moe",
    "GlmMoeDsa",
    "Bailing",
    "MistralLarge3",
    "Pixtral",
)


# `adaptive_spec_params.adaptive_unsupported_reason`: anything else runs static steps.
ADAPTIVE_ALGORITHMS = ("EAGLE", "EAGLE3")


class LaunchError(ValueError):
    """A flag combination SGLang itself refuses at start-up; the emulator exits non-zero."""


@dataclass(frozen=True, slots=True)
class SpecConfig:
    """The resolved speculative-decoding triple: what /server_info reports."""

    algorithm: str
    num_steps: int
    eagle_topk: int
    num_draft_tokens: int
    adaptive: bool = False  # --speculative-adaptive: steps follow the running batch (model.py)

    @property
    def reserved_tokens(self) -> int:
        """Tokens the tokenizer adds to a prompt's length in the context check (§1.2)."""
        if self.algorithm not in RESERVING_ALGORITHMS:
            return 0
        return max(self.eagle_topk * self.num_steps, self.num_draft_tokens)


DEFAULT_CRASH_LINE = "RuntimeError: emulated engine crash (--emulator-crash-at-running)"


@dataclass(frozen=True, slots=True)
class CrashKnobs:
    """When the emulator dies on purpose: once `at_running` requests run (printing `line`
    as its last error, as SGLang's scheduler does), on receiving `on_prompt`, or once a
    sequence has streamed `after_tokens` tokens; with `once_path`, only while that file does
    not exist (it is created just before dying)."""

    at_running: int | None = None
    line: str = DEFAULT_CRASH_LINE
    on_prompt: str | None = None
    after_tokens: int | None = None
    once_path: str | None = None


@dataclass(frozen=True, slots=True)
class EngineArgs:
    """Everything the emulator needs from its argv, after SGLang's defaulting rules."""

    model_path: str
    served_model_name: str
    host: str
    port: int
    tp_size: int
    dp_size: int
    max_running_requests: int
    max_queued_requests: int | None
    context_length: int
    context_length_given: bool
    reasoning_parser: str | None
    spec: SpecConfig | None
    draft_model_path: str | None
    api_key: str | None
    enable_metrics: bool
    log_level: str
    mem_fraction_static: float
    skip_server_warmup: bool
    allow_auto_truncate: bool
    architectures: list[str]
    model_type: str
    extra: dict[str, Any]
    crash: CrashKnobs | None = None
    stream_interval: int = 1  # --stream-interval: tokens between a stream's chunks
    incremental_streaming_output: bool = False  # stream chunks carry only the new text and ids

    @property
    def reserved_tokens(self) -> int:
        return self.spec.reserved_tokens if self.spec else 0

    @property
    def max_total_num_tokens(self) -> int:
        return KV_POOL_TOKENS_PER_GPU * self.tp_size

    @property
    def max_req_input_len(self) -> int:
        """`min(context_len - 1, kv_tokens - 1) - 5`, the scheduler's input limit (§4)."""
        return min(self.context_length - 1, self.max_total_num_tokens - 1) - 5


def human_int(value: str) -> int:
    """`--context-length` takes `32768`, `32k` or `1M` (k = 1024, M = 1024²)."""
    text = value.strip().lower().replace("_", "")
    for suffix, factor in (("k", 1024), ("m", 1024 * 1024)):
        if text.endswith(suffix):
            return int(float(text[:-1]) * factor)
    return int(text)


def build_parser() -> argparse.ArgumentParser:
    """The subset of SGLang's flags the emulator acts on, spelled as SGLang spells them."""
    p = argparse.ArgumentParser(
        prog="python -m genfleet.workers.engine.emulator", allow_abbrev=True
    )
    p.add_argument("--model-path", "--model", dest="model_path", required=True)
    p.add_argument("--served-model-name", default=None)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=30000)
    p.add_argument("--tp-size", "--tensor-parallel-size", dest="tp_size", type=int, default=1)
    p.add_argument("--dp-size", "--data-parallel-size", dest="dp_size", type=int, default=1)
    p.add_argument("--max-running-requests", type=int, default=None)
    p.add_argument("--max-queued-requests", type=int, default=None)
    p.add_argument("--stream-interval", type=int, default=1)
    p.add_argument("--incremental-streaming-output", action="store_true")
    p.add_argument("--context-length", type=human_int, default=None)
    p.add_argument("--reasoning-parser", default=None)
    p.add_argument("--speculative-algorithm", default=None)
    p.add_argument("--speculative-draft-model-path", "--speculative-draft-model", default=None)
    p.add_argument("--speculative-num-steps", type=int, default=None)
    p.add_argument("--speculative-eagle-topk", type=int, default=None)
    p.add_argument("--speculative-num-draft-tokens", type=int, default=None)
    p.add_argument("--speculative-adaptive", action="store_true")
    p.add_argument("--api-key", default=None)
    p.add_argument("--enable-metrics", action="store_true")
    p.add_argument("--log-level", default="info")
    p.add_argument("--mem-fraction-static", type=float, default=None)
    p.add_argument("--skip-server-warmup", action="store_true")
    p.add_argument("--allow-auto-truncate", action="store_true")
    p.add_argument("--tool-call-parser", default=None)
    p.add_argument("--trust-remote-code", action="store_true")
    p.add_argument("--attention-backend", default=None)
    p.add_argument(
        "--mamba-radix-cache-strategy",
        "--mamba-scheduler-strategy",
        dest="mamba_radix_cache_strategy",
        default="auto",
    )
    # The emulator's own (fault tests): see the module docstring.
    p.add_argument("--emulator-crash-at-running", type=int, default=None)
    p.add_argument("--emulator-crash-line", default=DEFAULT_CRASH_LINE)
    p.add_argument("--emulator-crash-on-prompt", default=None)
    p.add_argument("--emulator-crash-after-tokens", type=int, default=None)
    p.add_argument("--emulator-crash-once", default=None)
    return p


def read_model_config(model_path: str) -> dict[str, Any]:
    """config.json of a local checkpoint directory, or {} when there is none to read."""
    path = Path(model_path) / "config.json"
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def resolve_spec(ns: argparse.Namespace, architecture: str) -> SpecConfig | None:
    """SGLang's speculative defaults: NEXTN → EAGLE, the auto triple, draft = steps + 1."""
    if ns.speculative_algorithm is None:
        return None
    algorithm = str(ns.speculative_algorithm).upper()
    if algorithm == "NEXTN":
        algorithm = "EAGLE"
    if algorithm == "NONE":
        return None
    if algorithm not in SPEC_ALGORITHMS:
        raise LaunchError(f"Unknown speculative algorithm name: {ns.speculative_algorithm}")
    steps, topk, draft = (
        ns.speculative_num_steps,
        ns.speculative_eagle_topk,
        ns.speculative_num_draft_tokens,
    )
    if algorithm == "NGRAM":
        return SpecConfig(algorithm, 12 // 10, 10, 12)
    if algorithm == "DFLASH":
        if ns.speculative_draft_model_path is None:
            raise LaunchError("DFLASH requires --speculative-draft-model-path")
        return SpecConfig(algorithm, 1, 1, draft or 16)
    if steps is None:
        if topk is not None or draft is not None:
            raise LaunchError(
                "AssertionError: --speculative-eagle-topk and --speculative-num-draft-tokens "
                "must be unset when --speculative-num-steps is unset"
            )
        steps, topk, draft = (5, 4, 8) if architecture in WIDE_DRAFT_ARCHS else (3, 1, 4)
        if algorithm == "STANDALONE":
            steps, topk, draft = 3, 1, 4
    topk = topk if topk is not None else 1
    if ns.speculative_adaptive and adaptive_runs(algorithm, topk):
        return SpecConfig(algorithm, steps, 1, steps + 1, adaptive=True)
    draft = draft if draft is not None else steps + 1
    if topk == 1 and draft != steps + 1:
        log.warning(
            "speculative_num_draft_tokens is adjusted to speculative_num_steps + 1 when "
            "speculative_eagle_topk == 1"
        )
        draft = steps + 1
    return SpecConfig(algorithm, steps, topk, draft)


def adaptive_runs(algorithm: str, topk: int) -> bool:
    """Whether SGLang keeps `--speculative-adaptive`; it warns and runs static steps if not."""
    if algorithm in ADAPTIVE_ALGORITHMS and topk == 1:
        return True
    log.warning(
        "speculative_adaptive disabled: %s. Falling back to static speculative params.",
        f"speculative_algorithm={algorithm} (only EAGLE/EAGLE3 are supported)"
        if algorithm not in ADAPTIVE_ALGORITHMS
        else f"speculative_eagle_topk={topk} (only topk=1 is supported)",
    )
    return False


def config_argv(argv: list[str]) -> list[str]:
    """`--config file.yaml` as SGLang merges it: the file's `flag: value` pairs as flags,
    before the command line's own (which win). How secrets such as the API key stay off argv.

    genfleet writes that file as a JSON object (valid YAML, and no YAML library needed here).
    """
    if "--config" not in argv:
        return argv
    at = argv.index("--config")
    if at + 1 >= len(argv):
        raise LaunchError("No config file specified after --config flag!")
    import json

    with open(argv[at + 1], encoding="utf-8") as handle:
        data = json.load(handle) or {}
    if not isinstance(data, dict):
        raise LaunchError("Config file must contain a dictionary at root level")
    merged: list[str] = []
    for key, value in data.items():
        flag = "--" + str(key).replace("_", "-")
        if value is True:
            merged.append(flag)
        elif value not in (False, None):
            merged += [flag, str(value)]
    return merged + argv[:at] + argv[at + 2 :]


def parse_args(argv: list[str]) -> EngineArgs:
    """SGLang's argv → EngineArgs; unknown flags are ignored, impossible ones raise LaunchError."""
    ns, _ignored = build_parser().parse_known_args(config_argv(argv))
    config = read_model_config(ns.model_path)
    architectures = config.get("architectures") or [DEFAULT_ARCHITECTURE]
    spec = resolve_spec(ns, str(architectures[0]))
    max_running = ns.max_running_requests
    if max_running is None and spec is not None:
        log.warning(
            "Max running requests is reset to 48 for speculative decoding. You can override "
            "this by explicitly setting --max-running-requests."
        )
        max_running = SPEC_MAX_RUNNING_REQUESTS
    served = ns.served_model_name or ns.model_path
    if ":" in served:
        raise LaunchError(f"served_model_name must not contain ':': {served!r}")
    context = ns.context_length or config.get("max_position_embeddings") or DEFAULT_CONTEXT_LENGTH
    draft_path = ns.speculative_draft_model_path
    if (
        spec is not None
        and draft_path is None
        and architectures[0].startswith(SELF_DRAFT_ARCH_PREFIXES)
    ):
        draft_path = ns.model_path
    return EngineArgs(
        model_path=ns.model_path,
        served_model_name=served,
        host=ns.host,
        port=ns.port,
        tp_size=ns.tp_size,
        dp_size=ns.dp_size,
        max_running_requests=max_running or AUTO_MAX_RUNNING_REQUESTS,
        max_queued_requests=ns.max_queued_requests,
        context_length=int(context),
        context_length_given=ns.context_length is not None,
        reasoning_parser=ns.reasoning_parser,
        spec=spec,
        draft_model_path=draft_path,
        api_key=ns.api_key,
        enable_metrics=ns.enable_metrics,
        log_level=str(ns.log_level).lower(),
        mem_fraction_static=ns.mem_fraction_static or DEFAULT_MEM_FRACTION_STATIC,
        skip_server_warmup=ns.skip_server_warmup,
        allow_auto_truncate=ns.allow_auto_truncate,
        architectures=[str(a) for a in architectures],
        model_type=str(config.get("model_type", "emulated")),
        stream_interval=max(1, ns.stream_interval),
        incremental_streaming_output=ns.incremental_streaming_output,
        extra={
            "tool_call_parser": ns.tool_call_parser,
            "trust_remote_code": ns.trust_remote_code,
            "attention_backend": ns.attention_backend,
            "mamba_radix_cache_strategy": ns.mamba_radix_cache_strategy,
        },
        crash=crash_knobs(ns),
    )


def crash_knobs(ns: argparse.Namespace) -> CrashKnobs | None:
    """The emulator's crash flags, None when none is given."""
    triggers = (
        ns.emulator_crash_at_running,
        ns.emulator_crash_on_prompt,
        ns.emulator_crash_after_tokens,
    )
    if all(t is None for t in triggers):
        if ns.emulator_crash_once is not None:
            raise LaunchError("--emulator-crash-once needs a crash flag to gate")
        return None
    for flag, value in (
        ("--emulator-crash-at-running", ns.emulator_crash_at_running),
        ("--emulator-crash-after-tokens", ns.emulator_crash_after_tokens),
    ):
        if value is not None and value < 1:
            raise LaunchError(f"{flag} must be at least 1")
    return CrashKnobs(
        ns.emulator_crash_at_running,
        ns.emulator_crash_line,
        ns.emulator_crash_on_prompt,
        ns.emulator_crash_after_tokens,
        ns.emulator_crash_once,
    )


def server_args_dict(args: EngineArgs) -> dict[str, Any]:
    """The flat ServerArgs part of /server_info. The API key is masked, unlike SGLang."""
    spec = args.spec
    return {
        "model_path": args.model_path,
        "tokenizer_path": args.model_path,
        "tokenizer_mode": "auto",
        "load_format": "auto",
        "context_length": args.context_length if args.context_length_given else None,
        "is_embedding": False,
        "served_model_name": args.served_model_name,
        "host": args.host,
        "port": args.port,
        "mem_fraction_static": args.mem_fraction_static,
        "max_running_requests": args.max_running_requests,
        "max_queued_requests": args.max_queued_requests,
        "max_total_tokens": None,
        "chunked_prefill_size": 8192,
        "max_prefill_tokens": 16384,
        "schedule_policy": "fcfs",
        "page_size": 1,
        "tp_size": args.tp_size,
        "dp_size": args.dp_size,
        "pp_size": 1,
        "ep_size": 1,
        "log_level": args.log_level,
        "api_key": "***" if args.api_key else None,
        "enable_metrics": args.enable_metrics,
        "reasoning_parser": args.reasoning_parser,
        "skip_server_warmup": args.skip_server_warmup,
        "allow_auto_truncate": args.allow_auto_truncate,
        "decode_log_interval": 40,
        "stream_interval": args.stream_interval,
        "incremental_streaming_output": args.incremental_streaming_output,
        "disable_overlap_schedule": False,
        "enable_mixed_chunk": False,
        "speculative_algorithm": spec.algorithm if spec else None,
        "speculative_draft_model_path": args.draft_model_path,
        "speculative_num_steps": spec.num_steps if spec else None,
        "speculative_eagle_topk": spec.eagle_topk if spec else None,
        "speculative_num_draft_tokens": spec.num_draft_tokens if spec else None,
        "speculative_adaptive": bool(spec and spec.adaptive),
        "speculative_accept_threshold_single": 1.0,
        "speculative_accept_threshold_acc": 1.0,
        **args.extra,
    }
