"""SGLang's command line and environment, built from settings by one pure function.

Supported SGLang releases: 0.5.11 (what the seed runs used) to 0.5.23 (the newest on PyPI),
checked flag by flag against each release's own source in `test_sglang_versions.py`.

Two eras, split at **0.5.14**, the first release after the spec-v2 retirement (upstream #27964)
and the mamba flag rename (#28151). Read from the wheels:

- 0.5.11 … 0.5.13.post1: `sglang/srt/environ.py` still declares
  `SGLANG_ENABLE_SPEC_V2 = EnvBool(True)`, and the only mamba flag is
  `--mamba-scheduler-strategy` (`server_args.py`). Speculative decoding on a Qwen hybrid
  (GDN) model with radix cache needs `SGLANG_ENABLE_SPEC_V2=1` and
  `--mamba-scheduler-strategy extra_buffer`, otherwise start-up fails with "Speculative
  decoding for … is not compatible with radix cache when using --mamba-scheduler-strategy
  no_buffer".
- 0.5.14 and later: `arg_groups/speculative_hook.py` only warns that `SGLANG_ENABLE_SPEC_V2`
  "has been removed", the field is `mamba_radix_cache_strategy` (`--mamba-radix-cache-strategy`),
  and `--mamba-scheduler-strategy` is a deprecated alias (still in 0.5.15) until it is
  dropped altogether (0.5.23 has no such flag: an argparse error).

`--speculative-adaptive` (adapt the draft steps at run time) is in every release from 0.5.11
on, but 0.5.11's `adaptive_spec_params.adaptive_unsupported_reason` turns it off, with only a
warning, whenever the overlap scheduler (spec v2) is on, which is SGLang's default: genfleet
passes it from **0.5.12**, the first release whose spec-v2 worker implements it, and refuses it
before. It needs EAGLE/EAGLE3 (NEXTN is EAGLE) and topk 1, else SGLang silently falls back to
static steps. From 0.5.13.post1 the steps also follow the batch size (`DEFAULT_ADAPTIVE_CONFIG`:
candidate steps [1,3,7] below 8 running requests, [0,1,3] from 8, [0,1] from 32, [0] from 64)
and `--speculative-num-steps` must be one of the candidates.

`--stream-interval` (tokens between the chunks of a streamed answer; SGLang's default is 1)
is in every supported release: `server_args.py` in 0.5.11, `arg_groups/fields/serving.py`
from the dataclass era on (0.5.23 too).

`sglang serve` (console script `sglang = sglang.cli.main:main`) exists from 0.5.5 on; older
releases get `python -m sglang.launch_server`, which newer ones still accept with a warning.
"""

from __future__ import annotations

import re
import shlex
import sys
from importlib import metadata

from genfleet.common.errors import ConfigError
from genfleet.common.model_identity import flag_values
from genfleet.common.settings import Settings
from genfleet.workers.engine.families import HYBRID_ARCHS, choose
from genfleet.workers.engine.launch import EngineLaunch
from genfleet.workers.engine.plan import DEFAULT_MAX_RUNNING_REQUESTS, EnginePlan

# SGLang's log line once its warm-up request was answered and its status is Up
# (`http_server.py::_wait_and_warmup`, logger.info): from then on /health answers 200.
SGLANG_READY_LINE = "The server is fired up and ready to roll!"


OLDEST_SGLANG = "0.5.11"
NEWEST_SGLANG = "0.5.23"
SUPPORTED_SGLANG = (OLDEST_SGLANG, NEWEST_SGLANG)

# First release without SGLANG_ENABLE_SPEC_V2 and with --mamba-radix-cache-strategy.
RADIX_CACHE_ERA = (0, 5, 14)
# First release that ships the `sglang serve` console script.
SERVE_SINCE = (0, 5, 5)

# First release whose default (spec-v2, overlap) scheduler runs --speculative-adaptive.
ADAPTIVE_SINCE = (0, 5, 12)
# Initial steps every adaptive release accepts (0.5.13–0.5.22 candidates: 0, 1, 3, 7).
ADAPTIVE_STEPS = (1, 3, 7)
ADAPTIVE_ALGORITHMS = ("EAGLE", "EAGLE3", "NEXTN")

LOOPBACK = "127.0.0.1"
# SGLang (0.5.15 at least) takes --port + 10000 as its gRPC port, served or not, and exits at
# start where that passes 65535 (`ServerArgs._handle_deprecated_args`).
MAX_SGLANG_PORT = 55535

# With speculative decoding and no --max-running-requests, SGLang silently caps the running
# batch at 48 (`speculative_hook.py::_handle_eagle_family`), which starves a saturating client:
# the builder always passes the flag, the plan's cap or DEFAULT_MAX_RUNNING_REQUESTS (plan.py).
SGLANG_PROGRAM = ["sglang", "serve"]
LEGACY_PROGRAM = [sys.executable, "-m", "sglang.launch_server"]


def sglang_launch(
    settings: Settings,
    port: int,
    version: str | None = None,
    program: list[str] | None = None,
    arch: str | None = None,
    plan: EnginePlan | None = None,
) -> EngineLaunch:
    """SGLang's argv and added environment for these settings, on 127.0.0.1:`port`.

    `version` is the SGLang release the command is for; None means `settings.sglang_version`,
    else the installed package (read from its metadata, never imported), else the newest
    supported. `arch` is `architectures[0]` of the checkpoint's config.json, read by the caller
    (`--model-architecture` wins); it decides the mamba cache flag for Qwen hybrid models
    (None: unknown, SGLang's `auto`) and the reasoning parser (`families.choose`). Before
    0.5.14 an unknown architecture with MTP on is refused: a Qwen hybrid model would fail at
    start without the flags only the architecture can decide.
    `program` replaces the entry point (the emulator takes the same flags). `plan` (the
    engine plan, `plan.make_plan`) gives the cap and memory flags where it planned; its MTP
    choice is already in `settings.mtp`.

    Examples:
        sglang_launch(Settings(model="/m/Qwen3.6-27B"), 30001, "0.5.23",
                      arch="Qwen3_5ForConditionalGeneration")
        # sglang serve --model-path /m/Qwen3.6-27B ... --speculative-algorithm EAGLE ...
        #   --mamba-radix-cache-strategy extra_buffer ...
        sglang_launch(settings, 30001, "0.5.11", arch="Qwen3_5ForConditionalGeneration")
        # SGLANG_ENABLE_SPEC_V2=1 sglang serve ... --mamba-scheduler-strategy extra_buffer ...
    """
    if settings.model is None:
        raise ConfigError("the sglang engine needs --model (a local checkpoint or a repo id)")
    release = parse_release(resolve_sglang_version(settings, version))
    arch = settings.model_architecture or arch
    if arch is None and settings.mtp and release < RADIX_CACHE_ERA:
        raise ConfigError(
            f"cannot read the architecture of {settings.model} (a hub id, or no readable "
            f"config.json), and SGLang {'.'.join(map(str, release))} needs it to start MTP: a "
            "Qwen3.5/3.6/Next checkpoint fails there without SGLANG_ENABLE_SPEC_V2=1 and "
            "--mamba-scheduler-strategy extra_buffer. Pass the checkpoint's architectures[0] "
            "as --model-architecture (GENFLEET_MODEL_ARCHITECTURE), e.g. "
            "Qwen3_5ForConditionalGeneration, or run without MTP: --no-mtp"
        )
    if program is None and port > MAX_SGLANG_PORT:
        raise ConfigError(
            f"engine port {port} is above {MAX_SGLANG_PORT}: SGLang derives its gRPC port as "
            f"--port + 10000 and refuses to start past 65535; set --port (GENFLEET_PORT) to "
            f"{MAX_SGLANG_PORT} or below (SGLang's default is 30000)"
        )
    choice = choose(settings, arch)
    served = settings.served_model_name or settings.model
    if ":" in served:
        raise ConfigError(
            f"SGLang rejects a served model name with ':' ({served!r}): set --served-model-name"
        )
    max_running = settings.max_running_requests or DEFAULT_MAX_RUNNING_REQUESTS
    planned = plan is not None and plan.planned

    argv = list(program) if program is not None else default_program(release)
    argv += ["--model-path", settings.model, "--served-model-name", served]
    argv += ["--tp-size", str(settings.tp_size), "--host", LOOPBACK, "--port", str(port)]
    if settings.mem_fraction_static is not None:
        argv += ["--mem-fraction-static", str(settings.mem_fraction_static)]
    if plan is not None and planned:
        argv += plan.argv()
    else:
        argv += ["--max-running-requests", str(max_running)]
    # Chunks every few dozen tokens, for the repetition guard (every release has the flag).
    argv += ["--stream-interval", str(settings.stream_chunk_tokens)]
    # Each chunk of a streamed answer holds its new ids and text only: answers are drawn by
    # ids (`/generate`), and cumulative chunks would resend all of them every time.
    argv.append("--incremental-streaming-output")
    if settings.context_length is not None:
        argv += ["--context-length", str(settings.context_length)]
    if choice.reasoning_parser:
        argv += ["--reasoning-parser", choice.reasoning_parser]
    if settings.tool_call_parser:
        argv += ["--tool-call-parser", settings.tool_call_parser]
    if settings.trust_remote_code:
        argv.append("--trust-remote-code")
    argv += speculative_args(settings, release)
    # The radix cache is off where the plan or the user's extra args turn it off.
    extra = shlex.split(settings.engine_extra_args)
    argv += mamba_args(settings, release, arch, radix="--disable-radix-cache" not in argv + extra)
    if settings.attention_backend:
        argv += ["--attention-backend", settings.attention_backend]
    argv += crash_workaround(settings, arch)[0]
    argv += graph_args(argv, extra, settings.tp_size)
    if settings.enable_metrics:
        argv.append("--enable-metrics")
    api_key = settings.engine_api_key.get_secret_value() if settings.engine_api_key else None
    argv += ["--log-level", settings.engine_log_level]
    argv += extra

    return EngineLaunch(
        kind="sglang",
        argv=argv,
        env=sglang_env(settings, release, arch),
        host=LOOPBACK,
        port=port,
        health_path="/health",
        ready_line=SGLANG_READY_LINE,
        api_key=api_key,
        # Through `--config`, not argv: `ps` shows every process's argv to every user.
        config={"api-key": api_key} if api_key else {},
    )


# Flags that already decide CUDA graphs: a user who passes one has chosen, genfleet adds none.
CUDA_GRAPH_FLAGS = ("--disable-cuda-graph", "--cuda-graph-max-bs", "--cuda-graph-bs")
CRASH_WORKAROUND = ["--disable-cuda-graph"]


# The largest decode batch SGLang captures a CUDA graph for by default on the cards the plan is
# for (up to 160 GB: `ServerArgs._handle_gpu_memory_settings`), below 4 GPUs a server and from 4
# on. A running batch above it runs eagerly: on an H200, 320 running without graphs gave 0.91 of
# 256 with them.
SGLANG_GRAPH_MAX_BS = 256
SGLANG_GRAPH_MAX_BS_TP4 = 512


def graphs_decided(words: list[str]) -> bool:
    """An engine argument among `words` turns CUDA graphs off or sizes them."""
    return any(word.split("=")[0] in CUDA_GRAPH_FLAGS for word in words)


def graph_args(argv: list[str], extra: list[str], tp_size: int = 1) -> list[str]:
    """`--cuda-graph-max-bs N` where the running cap N (the last `--max-running-requests` of
    `argv` and `extra`) is above the graphs SGLang captures by default, so that a full batch
    runs in a graph (of `tp_size` GPUs); nothing where CUDA graphs are already decided (turned
    off, or sized)."""
    words = argv + extra
    if graphs_decided(words):
        return []
    caps = flag_values(words, "--max-running-requests")
    cap = int(caps[-1]) if caps and caps[-1].isdigit() else 0  # SGLang takes the last
    captured = SGLANG_GRAPH_MAX_BS_TP4 if tp_size >= 4 else SGLANG_GRAPH_MAX_BS
    return ["--cuda-graph-max-bs", str(cap)] if cap > captured else []


def crash_workaround(settings: Settings, arch: str | None) -> tuple[list[str], str | None]:
    """Flags that keep SGLang out of a crash known for this configuration, and why; ([], None)
    where none is known.

    SGLang 0.5.15, measured on an H200: a Qwen hybrid (Gated-DeltaNet) model with MTP (EAGLE)
    on the triton attention backend with CUDA graphs dies within seconds once the running batch
    reaches the largest captured graph size (`_update_target_verify_buffers`: "The expanded
    size of the tensor (33554432) must match the existing size (33558528)"): the verify mask
    of a full graph batch outgrows its buffer by batch x draft tokens squared. genfleet reaches
    that size by design (it keeps cap x 1.25 + 4 requests in flight), so every restart dies the
    same way. `--disable-cuda-graph` avoids it (bench/real_sglang/README.md has the runs).
    """
    if not (settings.mtp and arch in HYBRID_ARCHS and settings.attention_backend == "triton"):
        return [], None
    if graphs_decided(shlex.split(settings.engine_extra_args)):
        return [], None
    why = (
        "--disable-cuda-graph: SGLang crashes with CUDA graphs on a hybrid model with MTP on "
        "the triton attention backend once the running batch reaches the largest captured graph "
        "(_update_target_verify_buffers, 'The expanded size of the tensor'); pass "
        "--engine-extra-args with a --cuda-graph-* flag to decide otherwise"
    )
    return list(CRASH_WORKAROUND), why


def speculative_args(settings: Settings, release: tuple[int, ...]) -> list[str]:
    """MTP flags: all four knobs spelled out, so nothing depends on SGLang's auto-choice.

    With `speculative_adaptive` also `--speculative-adaptive`, and the draft tokens are
    steps + 1 (what SGLang sets under adaptive); `check_adaptive` refuses what SGLang would
    silently run with static steps.
    """
    if not settings.mtp:
        return []
    if settings.speculative_adaptive:
        check_adaptive(settings, release)
        return [
            "--speculative-algorithm",
            settings.speculative_algorithm,
            "--speculative-adaptive",
            "--speculative-num-steps",
            str(settings.speculative_num_steps),
            "--speculative-eagle-topk",
            "1",
            "--speculative-num-draft-tokens",
            str(settings.speculative_num_steps + 1),
        ]
    return [
        "--speculative-algorithm",
        settings.speculative_algorithm,
        "--speculative-num-steps",
        str(settings.speculative_num_steps),
        "--speculative-eagle-topk",
        str(settings.speculative_eagle_topk),
        "--speculative-num-draft-tokens",
        str(settings.speculative_num_draft_tokens),
    ]


def adaptive_supported(release: tuple[int, ...]) -> bool:
    """True when this SGLang release runs `--speculative-adaptive` under its default scheduler."""
    return release >= ADAPTIVE_SINCE


def check_adaptive(settings: Settings, release: tuple[int, ...]) -> None:
    """Raise ConfigError where SGLang would drop `--speculative-adaptive` or refuse to start."""
    version = ".".join(map(str, release))
    if not adaptive_supported(release):
        raise ConfigError(
            f"--speculative-adaptive needs SGLang 0.5.12 or later; {version} (0.5.11 and "
            "before) runs it only with the overlap scheduler off and otherwise falls back to "
            "static steps with a warning. Upgrade SGLang or drop --speculative-adaptive"
        )
    if settings.speculative_algorithm.upper() not in ADAPTIVE_ALGORITHMS:
        raise ConfigError(
            f"--speculative-adaptive works with EAGLE, EAGLE3 or NEXTN only, not "
            f"{settings.speculative_algorithm}: SGLang would run static steps"
        )
    if settings.speculative_eagle_topk != 1:
        raise ConfigError(
            f"--speculative-adaptive needs --speculative-eagle-topk 1, got "
            f"{settings.speculative_eagle_topk}: SGLang would run static steps"
        )
    if settings.speculative_num_steps not in ADAPTIVE_STEPS:
        raise ConfigError(
            f"--speculative-adaptive starts from --speculative-num-steps "
            f"{'/'.join(map(str, ADAPTIVE_STEPS))}, got {settings.speculative_num_steps}: "
            "SGLang refuses steps outside its adaptive candidates"
        )


def mamba_args(
    settings: Settings, release: tuple[int, ...], arch: str | None, radix: bool = True
) -> list[str]:
    """The mamba cache flag, spelled for the release.

    An explicit `mamba_cache_strategy` is always passed. Otherwise only MTP on a Qwen hybrid
    arch with the radix cache on gets `extra_buffer` (what the cookbooks pass, and what old
    releases need for spec decoding with radix cache); everything else is left to SGLang's
    `auto` (the strategy is the radix cache's: without one there is none to choose).
    """
    strategy = settings.mamba_cache_strategy
    if strategy is None and radix and settings.mtp and arch in HYBRID_ARCHS:
        strategy = "extra_buffer"
    if strategy is None:
        return []
    flag = (
        "--mamba-radix-cache-strategy"
        if release >= RADIX_CACHE_ERA
        else "--mamba-scheduler-strategy"
    )
    return [flag, strategy]


def sglang_env(settings: Settings, release: tuple[int, ...], arch: str | None) -> dict[str, str]:
    """Environment the release needs: SGLANG_ENABLE_SPEC_V2=1 for Qwen hybrid MTP before 0.5.14.

    Later releases removed the variable (they only warn about it), so it is not set there.
    """
    if settings.mtp and arch in HYBRID_ARCHS and release < RADIX_CACHE_ERA:
        return {"SGLANG_ENABLE_SPEC_V2": "1"}
    return {}


def default_program(release: tuple[int, ...]) -> list[str]:
    """`sglang serve` where the release has it, else the module entry point."""
    return list(SGLANG_PROGRAM if release >= SERVE_SINCE else LEGACY_PROGRAM)


def resolve_sglang_version(settings: Settings, version: str | None = None) -> str:
    """The release to build for: explicit, then settings, then installed, then the newest."""
    return version or settings.sglang_version or installed_sglang_version() or NEWEST_SGLANG


def installed_sglang_version() -> str | None:
    """The installed sglang's version from its metadata; importing sglang needs a GPU stack."""
    try:
        return metadata.version("sglang")
    except metadata.PackageNotFoundError:
        return None


def parse_release(version: str) -> tuple[int, ...]:
    """`"0.5.13.post1"` → `(0, 5, 13)`: the release numbers, padded to three."""
    found = re.match(r"^v?(\d+(?:\.\d+)*)", version.strip())
    if found is None:
        raise ConfigError(f"not an SGLang version: {version!r} (expected e.g. 0.5.23)")
    numbers = tuple(int(part) for part in found.group(1).split("."))
    return (numbers + (0, 0, 0))[:3]
