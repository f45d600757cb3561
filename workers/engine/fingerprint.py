"""What a worker's engine serves, beyond its name: the checkpoint's identity.

Two workers can serve the same served name from different checkpoints, quantizations,
reasoning parsers or thinking switches; their answers are not the same model's. A worker
computes its identity once at start (`checkpoint_identity`: pure but for reading its
checkpoint folder's small files and a few MiB of each weight file), and compares it with the
model each run recorded at staging (`common.model_identity.judge`): a worker that does not serve a
run's model hands that run's orders back and keeps taking other runs'.

The identity holds:

- the engine kind, the served name (`routing.model_ref`), the checkpoint `--model` names and
  its content digest (`common.checkpoint_digest`: the small files whole, each weight file's
  name, size and sampled MiB) where it is a folder here; a hub id is a name only, and the
  emulator has no checkpoint (it is a model of its own);
- `serves`: each knob that changes answers under one name (quantization, reasoning parser,
  thinking switch) as this worker serves it, and its default (the checkpoint's own
  quantization, the family's parser and switch), so that a run that asked for none is served
  only by a worker that did not override it;
- the fields an older genfleet recorded (hashes of `config.json` and the weight index, the
  resolved knobs), for runs whose first worker wrote their `RUN/model.json`;
- `fingerprint`: sha256 over all of it, a short name for logs and findings.
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any

import orjson

from genfleet.common.model_identity import checkpoint_of, quantization_flag
from genfleet.common.routing import model_ref
from genfleet.common.settings import Settings
from genfleet.workers.engine.families import NONE, ModelChoice, choose

CONFIG_FILE = "config.json"
INDEX_FILE = "model.safetensors.index.json"


def _file_sha256(path: Path) -> str | None:
    try:
        return hashlib.sha256(path.read_bytes()).hexdigest()
    except OSError:
        return None


def _config_quantization(config: Path | None) -> str | None:
    """config.json's `quantization_config.quant_method`: the checkpoint's own quantization."""
    if config is None:
        return None
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
    checkpoint, content = checkpoint_of(settings)
    own_quantization = _config_quantization(root / CONFIG_FILE if local and root else None)
    quantization = quantization_flag(settings.engine_extra_args) or own_quantization
    # The family's own choices: what a run that names no parser or switch asks for.
    own = choose(
        settings.model_copy(update={"reasoning_parser": None, "thinking_switch": None}),
        choice.arch,
    )
    identity: dict[str, Any] = {
        "engine": ref.engine,
        "model": ref.model,
        "checkpoint": checkpoint,
        "content_sha256": content,
        "serves": {
            "quantization": {"value": quantization, "default": own_quantization},
            "reasoning_parser": {
                "value": choice.reasoning_parser or NONE,
                "default": own.reasoning_parser or NONE,
            },
            "thinking_switch": {
                "value": choice.thinking_key or NONE,
                "default": own.thinking_key or NONE,
            },
        },
        "config_sha256": _file_sha256(root / CONFIG_FILE) if local and root else None,
        "weights_index_sha256": _file_sha256(root / INDEX_FILE) if local and root else None,
        "quantization": quantization,
        "reasoning_parser": choice.reasoning_parser,
        "thinking_switch": choice.thinking_key,
        "thinking_default": choice.thinking_default,
    }
    canonical = orjson.dumps(identity, option=orjson.OPT_SORT_KEYS)
    identity["fingerprint"] = hashlib.sha256(canonical).hexdigest()
    return identity
