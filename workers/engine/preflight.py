"""Checks on a checkpoint before any GPU time is spent on it.

SGLang never probes a checkpoint for MTP weights: with `--speculative-algorithm` set it builds
the draft from the target checkpoint and loads whatever names match, so a checkpoint without
them starts fine and decodes with an untrained draft (accept length pinned at 1.0,
sglang#35797). Preflight reads only `config.json`, the safetensors index and safetensors
headers (the 8-byte length and the JSON after it), never the weights.

Where SGLang looks for MTP weights (`sglang-contract.md` §2):

- Qwen3-Next, Qwen3.5, Qwen3.6: tensor names containing `mtp` (`models/qwen3_next.py`,
  `models/qwen3_5_mtp.py`).
- DeepSeek-V3 style NextN (`num_nextn_predict_layers` in config.json): the extra layer
  `model.layers.{num_hidden_layers}.*`.
- Only files named in `model.safetensors.index.json` are read when the index exists, so an
  `mtp.safetensors` the index does not reference is never loaded (GLM-4 MoE excepted).
"""

from __future__ import annotations

import json
import re
import struct
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from genfleet.common.errors import PreflightError
from genfleet.common.settings import Settings
from genfleet.workers.engine.families import family_of

INDEX_FILE = "model.safetensors.index.json"
MTP_FILE = "mtp.safetensors"
MAX_HEADER_BYTES = 100 * 1024 * 1024

# `loader.py::maybe_add_mtp_safetensors` loads an unindexed mtp.safetensors for these only.
MTP_FILE_AUTOLOAD_PREFIX = "Glm4Moe"

REPO_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


@dataclass(frozen=True)
class PreflightReport:
    """What preflight found; `mtp_tensors` is None when MTP was not checked."""

    model: str
    checked: bool  # False: not a local directory, nothing could be read
    arch: str | None = None
    num_hidden_layers: int | None = None
    mtp: bool = True
    mtp_layout: str | None = None  # "mtp-names" | "nextn-layer" | None (unknown)
    mtp_tensors: int | None = None
    warnings: list[str] = field(default_factory=list)

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def preflight(settings: Settings) -> PreflightReport:
    """Fail with PreflightError when the engine could not start or MTP would silently be dead.

    A repo id that is not a local directory cannot be checked: that is a warning, since SGLang
    downloads it itself.
    """
    model = settings.model
    if not model:
        raise PreflightError("preflight needs --model (a checkpoint directory)")
    path = Path(model).expanduser()
    if not path.exists():
        if REPO_ID.match(model):
            warning = f"{model}: not a local directory, cannot check (SGLang will fetch it)"
            return PreflightReport(model, checked=False, mtp=settings.mtp, warnings=[warning])
        raise PreflightError(f"{model}: model directory does not exist")
    if not path.is_dir():
        raise PreflightError(f"{model}: not a directory (give the checkpoint's directory)")

    config = read_config(path)
    arch = architecture(config)
    layers = text_config_value(config, "num_hidden_layers")
    warnings: list[str] = []
    if arch is None:
        warnings.append(f"{path / 'config.json'}: no architectures entry")
    num_hidden_layers = layers if isinstance(layers, int) else None
    if not settings.mtp:
        return PreflightReport(model, True, arch, num_hidden_layers, False, warnings=warnings)

    layout = mtp_layout(arch, config)
    if layout is None:
        warnings.append(
            f"{model}: no known MTP weight layout for {arch or 'this architecture'}: "
            "MTP weights cannot be verified (check the accept length after start-up)"
        )
        return PreflightReport(model, True, arch, num_hidden_layers, True, warnings=warnings)
    count = check_mtp_weights(model, path, arch, config, layout, warnings)
    return PreflightReport(model, True, arch, num_hidden_layers, True, layout, count, warnings)


def check_mtp_weights(
    model: str,
    path: Path,
    arch: str | None,
    config: dict[str, Any],
    layout: str,
    warnings: list[str],
) -> int:
    """How many MTP tensors SGLang would load; PreflightError when there are none."""
    if layout == "nextn-layer":
        nextn = text_config_value(config, "num_nextn_predict_layers")
        if not isinstance(nextn, int) or nextn < 1:
            raise PreflightError(
                f"{model}: MTP is on but config.json has no num_nextn_predict_layers "
                f"({arch} reads its NextN layer from it). Run without MTP: --no-mtp"
            )
    names, files, indexed = loaded_tensor_names(path)
    if not files:
        warnings.append(
            f"{model}: no *.safetensors files: MTP weights cannot be verified "
            "(check the accept length after start-up)"
        )
        return 0
    is_mtp, looked_for = mtp_matcher(layout, config)
    count = sum(1 for name in names if is_mtp(name))

    stray = path / MTP_FILE
    if indexed and stray.is_file() and MTP_FILE not in files:
        stray_count = sum(1 for name in safetensors_names(stray) if is_mtp(name))
        if arch is not None and arch.startswith(MTP_FILE_AUTOLOAD_PREFIX):
            count += stray_count
        elif count == 0:
            raise PreflightError(
                f"{model}: {MTP_FILE} ({stray_count} MTP tensors) is not referenced by "
                f"{INDEX_FILE}: SGLang only loads the files the index names, so it would "
                "silently not load the MTP weights (a checkpoint packaging bug). Add its "
                "tensors to the index weight_map, or run without MTP: --no-mtp"
            )
        else:
            warnings.append(f"{model}: {MTP_FILE} is not referenced by {INDEX_FILE}; ignored")
    if count == 0:
        source = INDEX_FILE if indexed else ", ".join(sorted(files))
        raise PreflightError(
            f"{model}: MTP is on but the checkpoint has no MTP weights: looked for {looked_for} "
            f"in {source} ({len(names)} tensors, none match). SGLang would start anyway and "
            "never accept a draft token. Use a checkpoint that ships them, or run without "
            "MTP: --no-mtp"
        )
    return count


def mtp_layout(arch: str | None, config: dict[str, Any]) -> str | None:
    """Where this architecture keeps MTP weights (`families.ARCHITECTURES`), or None when
    genfleet does not know; a config with `num_nextn_predict_layers` is a NextN layout."""
    family = family_of(arch)
    if family is not None and family.mtp_layout is not None:
        return family.mtp_layout
    if text_config_value(config, "num_nextn_predict_layers"):
        return "nextn-layer"
    return None


def mtp_matcher(layout: str, config: dict[str, Any]) -> tuple[Callable[[str], bool], str]:
    """A predicate on tensor names for the layout, and what it looks for, in words."""
    if layout == "mtp-names":
        return (lambda name: "mtp" in name), "tensor names containing 'mtp'"
    first = text_config_value(config, "num_hidden_layers")
    nextn = text_config_value(config, "num_nextn_predict_layers")
    if not isinstance(first, int):
        raise PreflightError("config.json has no integer num_hidden_layers")
    layers = range(first, first + (nextn if isinstance(nextn, int) and nextn > 0 else 1))
    prefixes = tuple(f"model.layers.{n}." for n in layers)
    return (lambda name: name.startswith(prefixes)), f"tensor names 'model.layers.{first}.*'"


def loaded_tensor_names(path: Path) -> tuple[list[str], set[str], bool]:
    """Tensor names SGLang would load, the files they come from, and whether an index says so."""
    index = path / INDEX_FILE
    if index.is_file():
        data = read_json(index)
        weight_map = data.get("weight_map") if isinstance(data, dict) else None
        if not isinstance(weight_map, dict):
            raise PreflightError(f"{index}: no weight_map object")
        return list(weight_map), {str(v) for v in weight_map.values()}, True
    files = sorted(p for p in path.glob("*.safetensors") if p.is_file())
    names = [name for file in files for name in safetensors_names(file)]
    return names, {file.name for file in files}, False


def safetensors_names(file: Path) -> list[str]:
    """Tensor names from a safetensors header: an 8-byte little-endian length, then JSON."""
    try:
        with file.open("rb") as handle:
            head = handle.read(8)
            if len(head) < 8:
                raise PreflightError(f"{file}: too short for a safetensors header")
            (length,) = struct.unpack("<Q", head)
            if length > MAX_HEADER_BYTES:
                raise PreflightError(f"{file}: header length {length} is not plausible")
            raw = handle.read(length)
    except OSError as exc:
        raise PreflightError(f"{file}: cannot read: {exc}") from exc
    try:
        header = json.loads(raw)
    except ValueError as exc:
        raise PreflightError(f"{file}: safetensors header is not JSON: {exc}") from exc
    if not isinstance(header, dict):
        raise PreflightError(f"{file}: safetensors header is not a JSON object")
    return [name for name in header if name != "__metadata__"]


def read_config(path: Path) -> dict[str, Any]:
    """config.json as a dict; PreflightError naming the file and the JSON error otherwise."""
    config_file = path / "config.json"
    if not config_file.is_file():
        raise PreflightError(f"{config_file}: missing (not a Hugging Face checkpoint?)")
    config = read_json(config_file)
    if not isinstance(config, dict):
        raise PreflightError(f"{config_file}: not a JSON object")
    return config


def read_json(file: Path) -> Any:
    try:
        return json.loads(file.read_text(encoding="utf-8"))
    except ValueError as exc:
        raise PreflightError(f"{file}: invalid JSON: {exc}") from exc
    except OSError as exc:
        raise PreflightError(f"{file}: cannot read: {exc}") from exc


def architecture(config: dict[str, Any]) -> str | None:
    """`architectures[0]`, the class SGLang picks its model (and MTP draft) by."""
    archs = config.get("architectures")
    if isinstance(archs, list) and archs and isinstance(archs[0], str):
        return archs[0]
    return None


def text_config_value(config: dict[str, Any], key: str) -> Any:
    """A key at top level or, for multimodal wrappers like Qwen3.5, under `text_config`."""
    if key in config:
        return config[key]
    text = config.get("text_config")
    return text.get(key) if isinstance(text, dict) else None


def checkpoint_arch(model: str | None) -> str | None:
    """`architectures[0]` of a local checkpoint, or None when it cannot be read (no error)."""
    if not model:
        return None
    try:
        return architecture(read_config(Path(model).expanduser()))
    except PreflightError:
        return None
