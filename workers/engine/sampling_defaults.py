"""The sampling defaults a checkpoint ships (its `generation_config.json`), read as SGLang does.

SGLang's chat endpoint fills `temperature`, `top_p`, `top_k`, `min_p` and
`repetition_penalty` a request leaves unset from the checkpoint's generation config
(`ModelConfig.get_default_sampling_params`, `--sampling-defaults model`); its native
`/generate` does not. A worker that draws answers by token ids sends those values itself, so
that an answer is sampled exactly as the chat endpoint would have sampled it: without them a
Qwen3 answer would lose its `top_k 20` and be a different distribution, silently.

The file is read from a local checkpoint directory, or from the Hugging Face cache where the
engine downloaded a hub id (`HF_HUB_CACHE`, `HF_HOME`, `~/.cache/huggingface`). None when the
checkpoint cannot be found at all: the caller then cannot know the defaults and must not guess.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

GENERATION_CONFIG = "generation_config.json"
# The fields SGLang takes from a generation config (model_config.py, get_default_sampling_params).
SAMPLING_FIELDS = ("repetition_penalty", "temperature", "top_k", "top_p", "min_p")


def hub_cache_dirs(env: dict[str, str] | None = None) -> list[Path]:
    """Where the Hugging Face cache may hold a hub id's snapshots, first match first."""
    env = dict(os.environ) if env is None else env
    dirs: list[Path] = []
    if env.get("HF_HUB_CACHE"):
        dirs.append(Path(env["HF_HUB_CACHE"]))
    home = Path(env["HF_HOME"]) if env.get("HF_HOME") else Path.home() / ".cache" / "huggingface"
    dirs.append(home / "hub")
    return dirs


def checkpoint_dir(model: str, env: dict[str, str] | None = None) -> Path | None:
    """A local directory holding the checkpoint: `model` itself, or the cached snapshot of a
    hub id (`refs/main`'s, else the newest)."""
    path = Path(model).expanduser()
    if path.is_dir():
        return path
    if model.count("/") != 1:
        return None
    for cache in hub_cache_dirs(env):
        repo = cache / ("models--" + model.replace("/", "--"))
        snapshots = repo / "snapshots"
        if not snapshots.is_dir():
            continue
        ref = repo / "refs" / "main"
        if ref.is_file():
            pinned = snapshots / ref.read_text().strip()
            if pinned.is_dir():
                return pinned
        found = sorted(snapshots.iterdir(), key=lambda p: p.stat().st_mtime, reverse=True)
        if found:
            return found[0]
    return None


def sampling_defaults(config: dict[str, Any]) -> dict[str, Any]:
    """The sampling fields a generation config sets (others are left to the engine's own)."""
    return {name: config[name] for name in SAMPLING_FIELDS if config.get(name) is not None}


def read_sampling_defaults(model: str, env: dict[str, str] | None = None) -> dict[str, Any] | None:
    """The checkpoint's sampling defaults ({} when it ships no generation config); None when
    the checkpoint is not found here, or its generation config cannot be read."""
    where = checkpoint_dir(model, env)
    if where is None:
        return None
    path = where / GENERATION_CONFIG
    if not path.exists():
        return {}
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return sampling_defaults(data) if isinstance(data, dict) else None
