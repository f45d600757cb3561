"""What the supervisor starts: a command, its environment and where it will answer.

Builders (SGLang's argv, the emulator, a user's command) are pure functions from settings to
an EngineLaunch; the supervisor only knows how to run one.
"""

from __future__ import annotations

import shlex
from collections.abc import Mapping
from dataclasses import dataclass, field

# What an engine process inherits from the worker: what CUDA, NCCL, PyTorch, Triton, Hugging
# Face and the engines themselves read, and the basics of a process. Never the worker's own
# secrets (Redis URL, AWS keys, Flower credentials): those are in none of these.
ENV_PREFIXES = (
    "CUDA_",
    "NCCL_",
    "NVIDIA_",
    "HF_",
    "HUGGINGFACE_",
    "TRANSFORMERS_",
    "SGLANG_",
    "VLLM_",
    "TORCH",
    "PYTORCH_",
    "TRITON_",
    "FLASHINFER_",
    "OMP_",
    "MKL_",
    "LC_",
    "XDG_",
)
ENV_NAMES = frozenset(
    {"PATH", "HOME", "USER", "LOGNAME", "LANG", "TZ", "TMPDIR", "SHELL", "TERM"}
    | {"LD_LIBRARY_PATH", "LD_PRELOAD", "PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV", "CC", "CXX"}
)


def engine_env(
    inherited: Mapping[str, str], own: Mapping[str, str], gpus: str | None
) -> dict[str, str]:
    """The engine's environment, built explicitly: the allowed part of the worker's, then the
    launch's own settings, then its GPUs.

    >>> engine_env({"PATH": "/bin", "AWS_SECRET_ACCESS_KEY": "x", "GENFLEET_REDIS_URL": "r"},
    ...            {"SGLANG_X": "1"}, "0,1")
    {'PATH': '/bin', 'SGLANG_X': '1', 'CUDA_VISIBLE_DEVICES': '0,1', 'PYTHONUNBUFFERED': '1'}
    """
    env = {k: v for k, v in inherited.items() if k in ENV_NAMES or k.startswith(ENV_PREFIXES)}
    env.update(own)
    if gpus is not None:
        env["CUDA_VISIBLE_DEVICES"] = gpus
    env.setdefault("PYTHONUNBUFFERED", "1")
    return env


def auth_headers(api_key: str | None) -> dict[str, str]:
    """The engine's API key as a bearer header (every call to an engine that has a key)."""
    return {"Authorization": f"Bearer {api_key}"} if api_key else {}


@dataclass(frozen=True)
class EngineLaunch:
    """A ready-to-spawn engine: argv, the environment it adds, and its loopback address."""

    kind: str  # "sglang" | "emulator" | "command"
    argv: list[str]
    env: dict[str, str] = field(default_factory=dict)
    host: str = "127.0.0.1"
    port: int = 30000
    health_path: str = "/health"
    # The line the engine logs once it serves (its warm-up request answered), or None: the
    # supervisor takes it as ready then, not a `health_path` poll later (SGLang's /health
    # sleeps a second before it answers 200: a second of every start and restart).
    ready_line: str | None = None
    api_key: str | None = None  # sent as a bearer token; never printed
    # Flags the engine reads from its `--config` file (written 0600 at spawn, a JSON object,
    # which is YAML) instead of argv, where `ps` would show them: the API key.
    config: dict[str, str] = field(default_factory=dict)

    @property
    def base_url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def describe(self) -> str:
        """The command line as a shell would take it, with the API key masked."""
        argv = list(self.argv)
        for i, arg in enumerate(argv[:-1]):
            if arg == "--api-key":
                argv[i + 1] = "***"
        env = " ".join(
            f"{k}={'***' if self.api_key and v == self.api_key else shlex.quote(v)}"
            for k, v in sorted(self.env.items())
        )
        cmd = shlex.join(argv)
        if self.config:
            names = ",".join(f"{name}=***" for name in sorted(self.config))
            cmd += f" --config <0600 file: {names}>"
        return f"{env} {cmd}" if env else cmd
