"""Which engine a worker launches, and how: one dispatch on `settings.engine_kind`.

- `sglang`: SGLang's own argv (`sglang_argv.sglang_launch`).
- `emulator`: the very same argv, run by `python -m genfleet.workers.engine.emulator`, so the
  supervision path tested without a GPU is the one used with one.
- `command`: any OpenAI-compatible server from `--engine-command`, with `{model}`, `{port}`
  and `{host}` filled in, health-checked on `--engine-health-path`.
- `external`: nothing to launch; someone else runs the engine at `--engine-url`.
"""

from __future__ import annotations

import dataclasses
import secrets
import shlex
import string
import sys
from collections.abc import Callable
from pathlib import Path

from pydantic import SecretStr

from genfleet.common.errors import ConfigError, PreflightError
from genfleet.common.settings import Settings
from genfleet.workers.engine import plan as engine_plan_rules
from genfleet.workers.engine.families import choose
from genfleet.workers.engine.launch import EngineLaunch
from genfleet.workers.engine.plan import EnginePlan, ModelShape
from genfleet.workers.engine.preflight import checkpoint_arch, read_config
from genfleet.workers.engine.sglang_argv import (
    LOOPBACK,
    NEWEST_SGLANG,
    crash_workaround,
    sglang_launch,
)

EMULATOR_PROGRAM = [sys.executable, "-m", "genfleet.workers.engine.emulator"]
EMULATED_MODEL = "genfleet/emulated"
COMMAND_PLACEHOLDERS = ("model", "port", "host")


def engine_launch(
    settings: Settings, port: int, arch: str | None = None, plan: EnginePlan | None = None
) -> EngineLaunch | None:
    """What to spawn for this worker's engine on loopback `port`; None for an external engine.

    `arch` is the checkpoint's `architectures[0]` (see `preflight.checkpoint_arch`); it only
    matters to SGLang's mamba flags. `plan`: SGLang's engine plan (`planned`), whose MTP choice
    `settings` already holds.
    """
    kind = settings.engine_kind
    if kind == "sglang":
        return sglang_launch(settings, port, arch=arch, plan=plan)
    if kind == "emulator":
        return emulator_launch(settings, port, arch)
    if kind == "command":
        return command_launch(settings, port)
    return None


def with_engine_key(settings: Settings, token: Callable[[], str] | None = None) -> Settings:
    """`settings` with an API key of its own for an engine genfleet launches on loopback
    (SGLang, the emulator) when none is given: without one, any local user reaches SGLang's
    admin endpoints (flush the cache, update weights, abort requests).

    The key reaches SGLang and the emulator through their 0600 `--config` file, never argv,
    and the worker's client, watchdog and supervisor send it. A user's `--engine-command`
    gets one too, in its environment (`COMMAND_KEY_ENV`: vLLM reads `VLLM_API_KEY`; another
    server takes it from `$GENFLEET_ENGINE_API_KEY` in a wrapper). An external engine is
    someone else's: it gets the key it is given.

    >>> with_engine_key(Settings(), lambda: "k").engine_api_key.get_secret_value()
    'k'
    """
    launched = ("sglang", "emulator", "command")
    if settings.engine_api_key is not None or settings.engine_kind not in launched:
        return settings
    key = (token or _new_key)()
    return settings.model_copy(update={"engine_api_key": SecretStr(key)})


def _new_key() -> str:
    """Hex: a URL-safe token can begin with '-', which SGLang's config parsing (and the
    emulator's) would read as a flag, and the engine would not start (1 start in 32)."""
    return secrets.token_hex(32)


def emulator_launch(settings: Settings, port: int, arch: str | None = None) -> EngineLaunch:
    """SGLang's argv for the newest release, run by the emulator, with its knobs in the env.

    The emulator reads its `GENFLEET_EMULATOR_*` settings from the environment, so knobs given
    as CLI flags to the worker reach it too.
    """
    emulated = settings.model_copy(
        update={"model": settings.model or EMULATED_MODEL, "engine": "emulator"}
    )
    launch = sglang_launch(emulated, port, NEWEST_SGLANG, EMULATOR_PROGRAM, arch)
    knobs = {
        name: value
        for name, value in settings.child_env().items()
        if name.startswith("GENFLEET_EMULATOR_")
    }
    return dataclasses.replace(launch, kind="emulator", env={**launch.env, **knobs})


# Where a command engine finds its API key: the environment, never argv (`ps` shows argv to
# every user). vLLM's `serve` reads VLLM_API_KEY as its --api-key.
COMMAND_KEY_ENV = ("GENFLEET_ENGINE_API_KEY", "VLLM_API_KEY")


def command_launch(settings: Settings, port: int) -> EngineLaunch:
    """The user's `--engine-command`, split like a shell would, placeholders filled per word.

    Examples:
        "vllm serve {model} --host {host} --port {port}"
        "transformers serve --port {port}"        # {model} is optional, {port} is not
    """
    template = settings.engine_command
    if not template:
        raise ConfigError("--engine command needs --engine-command")
    words = shlex.split(template)
    used = {name for word in words for name in placeholders(word)}
    unknown = sorted(used - set(COMMAND_PLACEHOLDERS))
    if unknown:
        raise ConfigError(
            f"--engine-command has unknown placeholder(s) {', '.join(unknown)}: "
            f"only {{model}}, {{port}} and {{host}} are filled in (write {{{{ }}}} for a brace)"
        )
    if "port" not in used:
        raise ConfigError(
            "--engine-command has no {port} placeholder: the worker picks the engine's port "
            f"and must pass it, e.g. {template!r} + ' --port {{port}}'"
        )
    if "model" in used and settings.model is None:
        raise ConfigError("--engine-command uses {model} but no --model was given")
    values = {"model": settings.model or "", "port": str(port), "host": LOOPBACK}
    api_key = settings.engine_api_key.get_secret_value() if settings.engine_api_key else None
    return EngineLaunch(
        kind="command",
        argv=[word.format_map(values) for word in words],
        env=dict.fromkeys(COMMAND_KEY_ENV, api_key) if api_key else {},
        host=LOOPBACK,
        port=port,
        health_path=settings.engine_health_path,
        api_key=api_key or None,
    )


def placeholders(word: str) -> list[str]:
    """The `{name}` fields in one word of a command template."""
    try:
        parsed = list(string.Formatter().parse(word))
    except ValueError as exc:
        raise ConfigError(f"--engine-command word {word!r}: {exc}") from exc
    return [field for _, field, _, _ in parsed if field is not None]


def planned(settings: Settings, arch: str | None) -> tuple[Settings, EnginePlan | None]:
    """The engine plan for this worker's SGLang, and `settings` with its MTP choice; (settings,
    None) where no plan applies (`--no-engine-plan`, another engine kind). The card's memory is
    `--plan-gpu`'s, else NVML's. ConfigError where the model cannot run on the card."""
    if settings.engine_kind != "sglang" or not settings.engine_plan:
        return settings, None
    shape = model_shape(settings.model)
    # CUDA graphs with MTP, unless genfleet's crash workaround would turn them off then.
    with_mtp = settings.model_copy(update={"mtp": True})
    graphs = not crash_workaround(with_mtp, settings.model_architecture or arch)[0]
    memory = card_memory_gib(settings)
    plan = engine_plan_rules.make_plan(
        shape, engine_plan_rules.inputs_of(settings, memory, mtp_graphs=graphs)
    )
    return settings.model_copy(update={"mtp": plan.mtp}), plan


def model_shape(model: str | None) -> ModelShape | None:
    """The shape of a local checkpoint (weights measured from its safetensors files, else
    estimated from config.json); None for a hub id or an unreadable config."""
    if not model:
        return None
    path = Path(model).expanduser()
    try:
        config = read_config(path)
    except PreflightError:
        return None
    weights = sum(f.stat().st_size for f in path.glob("*.safetensors")) or None
    try:
        return ModelShape.from_config(config, weights)
    except ConfigError:
        return None


def card_memory_gib(settings: Settings) -> float | None:
    """The memory of one of this worker's GPUs: `--plan-gpu` (a card's name or GiB), else
    NVML's total of its first GPU; None when neither is there."""
    if settings.plan_gpu:
        return engine_plan_rules.card_memory_gib(settings.plan_gpu)
    from genfleet.workers.observe.telemetry import NvmlSampler

    gpus = [g.strip() for g in settings.gpus.split(",")] if settings.gpus else None
    sampler = NvmlSampler(gpus)
    try:
        totals = [s.memory_total_mib for s in sampler.sample() if s.memory_total_mib]
    finally:
        sampler.close()
    return min(totals) / 1024 if totals else None


def print_engine_command(settings: Settings, port: int | None = None) -> str:
    """The exact command and added environment `genfleet worker` would launch, key masked,
    a comment line naming the model family, reasoning parser and thinking switch, and the
    engine plan: each flag it chose and why.

    Reads the architecture from a local checkpoint as the worker does; `port` defaults to the
    configured one (a worker per GPU group adds its offset). `--plan-gpu h100` plans for a
    card without one.
    """
    if settings.engine_kind == "external":
        return f"# external engine at {settings.engine_url}: genfleet launches nothing"
    chosen = settings.port if port is None else port
    arch = checkpoint_arch(settings.model)
    settings, plan = planned(settings, arch)
    launch = engine_launch(settings, chosen, arch, plan)
    if launch is None:
        return f"# {settings.engine_kind} engine: genfleet launches nothing"
    text = f"{launch.describe()}\n{choose(settings, arch).describe()}"
    if plan is not None:
        text += f"\n{plan.describe()}"
    if settings.engine_kind == "sglang":
        _, why = crash_workaround(settings, arch)
        if why:
            text += f"\n# avoids a known SGLang crash: {why}"
        if (
            "--cuda-graph-max-bs" in launch.argv
            and "--cuda-graph-max-bs" not in settings.engine_extra_args
        ):
            size = launch.argv[launch.argv.index("--cuda-graph-max-bs") + 1]
            text += (
                f"\n# --cuda-graph-max-bs {size}: a full batch runs in a CUDA graph (SGLang "
                "captures fewer by default and runs a larger batch eagerly)"
            )
    return text
