"""What a worker's engine serves, beyond its name: the checkpoint's fingerprint.

Two workers can serve the same served name from different checkpoints, quantizations,
reasoning parsers or thinking switches; their answers are not the same model's. A worker
computes its fingerprint once at start (`checkpoint_identity`, pure but for reading two small
files of a local checkpoint); the first worker to generate a batch of a run records it in the
run (`RUN/model.json`, write-once), and a worker whose fingerprint differs hands the order back
and says which fields differ (`differences`).

The config and weight-index hashes are known only for a checkpoint on local disk (a path); for
a hub id or an external engine the fingerprint is the name, engine, quantization, parser and
switch.
"""

from __future__ import annotations

import hashlib
import shlex
from pathlib import Path
from typing import Any

import orjson

from genfleet.common.routing import model_ref
from genfleet.common.settings import Settings
from genfleet.workers.engine.families import ModelChoice

CONFIG_FILE = "config.json"
INDEX_FILE = "model.safetensors.index.json"
FIELDS = (
    "engine",
    "model",
    "config_sha256",
    "weights_index_sha256",
    "quantization",
    "reasoning_parser",
    "thinking_switch",
    "thinking_default",
)


def _file_sha256(path: Path) -> str | None:
    try:
        return hashlib.sha256(path.read_bytes()).hexdigest()
    except OSError:
        return None


def _quantization(settings: Settings, config: Path) -> str | None:
    """`--quantization X` among the engine's extra args, else config.json's quant_method."""
    args = shlex.split(settings.engine_extra_args or "")
    for i, arg in enumerate(args):
        if arg == "--quantization" and i + 1 < len(args):
            return args[i + 1]
        if arg.startswith("--quantization="):
            return arg.split("=", 1)[1]
    try:
        data = orjson.loads(config.read_bytes())
    except (OSError, orjson.JSONDecodeError):
        return None
    quant = data.get("quantization_config") if isinstance(data, dict) else None
    method = quant.get("quant_method") if isinstance(quant, dict) else None
    return str(method) if method else None


def checkpoint_identity(settings: Settings, choice: ModelChoice) -> dict[str, Any]:
    """The worker's model identity, with `fingerprint` (sha256 over the other fields)."""
    ref = model_ref(settings)
    root = Path(settings.model).expanduser() if settings.model else None
    local = root is not None and root.is_dir()
    identity: dict[str, Any] = {
        "engine": ref.engine,
        "model": ref.model,
        "config_sha256": _file_sha256(root / CONFIG_FILE) if local and root else None,
        "weights_index_sha256": _file_sha256(root / INDEX_FILE) if local and root else None,
        "quantization": _quantization(settings, root / CONFIG_FILE if root else Path("/-")),
        "reasoning_parser": choice.reasoning_parser,
        "thinking_switch": choice.thinking_key,
        "thinking_default": choice.thinking_default,
    }
    canonical = orjson.dumps({k: identity[k] for k in FIELDS}, option=orjson.OPT_SORT_KEYS)
    identity["fingerprint"] = hashlib.sha256(canonical).hexdigest()
    return identity


def differences(recorded: dict[str, Any], mine: dict[str, Any]) -> list[str]:
    """`field: the run has X, this worker Y` for each field that differs."""
    return [
        f"{name}: the run has {recorded.get(name)!r}, this worker {mine.get(name)!r}"
        for name in FIELDS
        if recorded.get(name) != mine.get(name)
    ]
