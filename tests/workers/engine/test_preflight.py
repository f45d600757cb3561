"""Preflight on small fake checkpoints: config.json, an index or safetensors headers, no weights."""

from __future__ import annotations

import json
import struct
from pathlib import Path
from typing import Any

import pytest

from genfleet.common.errors import PreflightError
from genfleet.common.settings import Settings
from genfleet.workers.engine.preflight import checkpoint_arch, preflight, safetensors_names

QWEN35_CONFIG = {
    "architectures": ["Qwen3_5ForConditionalGeneration"],
    "text_config": {"num_hidden_layers": 4, "mtp_num_hidden_layers": 1},
}
DEEPSEEK_CONFIG = {
    "architectures": ["DeepseekV3ForCausalLM"],
    "num_hidden_layers": 3,
    "num_nextn_predict_layers": 1,
}
QWEN_BODY = [
    "model.language_model.embed_tokens.weight",
    "model.language_model.layers.0.linear_attn.in_proj_qkvz.weight",
    "lm_head.weight",
]
QWEN_MTP = ["mtp.fc.weight", "mtp.layers.0.mlp.gate_proj.weight", "mtp.norm.weight"]


def checkpoint(
    root: Path, config: dict[str, Any] | str, weight_map: dict[str, str] | None = None
) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    text = config if isinstance(config, str) else json.dumps(config)
    (root / "config.json").write_text(text)
    if weight_map is not None:
        index = {"metadata": {"total_size": 0}, "weight_map": weight_map}
        (root / "model.safetensors.index.json").write_text(json.dumps(index))
    return root


def write_safetensors(file: Path, names: list[str]) -> None:
    """A header-only safetensors file: each tensor is zero bytes long."""
    header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    header.update({n: {"dtype": "BF16", "shape": [0], "data_offsets": [0, 0]} for n in names})
    raw = json.dumps(header).encode()
    file.write_bytes(struct.pack("<Q", len(raw)) + raw)


def sharded(names: list[str], file: str = "model-00001-of-00002.safetensors") -> dict[str, str]:
    return dict.fromkeys(names, file)


def run(model: Path | str, **kw: Any) -> Any:
    return preflight(Settings(model=str(model), **kw))


def test_qwen_index_with_mtp_tensors(tmp_path: Path) -> None:
    weights = sharded(QWEN_BODY) | sharded(QWEN_MTP, "model-00002-of-00002.safetensors")
    report = run(checkpoint(tmp_path / "q", QWEN35_CONFIG, weights))
    assert report.checked
    assert (report.arch, report.num_hidden_layers) == ("Qwen3_5ForConditionalGeneration", 4)
    assert (report.mtp_layout, report.mtp_tensors, report.warnings) == ("mtp-names", 3, [])
    assert report.to_json()["mtp_tensors"] == 3


def test_qwen_index_without_mtp_tensors(tmp_path: Path) -> None:
    model = checkpoint(tmp_path / "q", QWEN35_CONFIG, sharded(QWEN_BODY))
    with pytest.raises(PreflightError) as caught:
        run(model)
    message = str(caught.value)
    assert str(model) in message
    assert "tensor names containing 'mtp'" in message
    assert "model.safetensors.index.json" in message
    assert "--no-mtp" in message


def test_without_mtp_weights_is_fine_with_no_mtp(tmp_path: Path) -> None:
    model = checkpoint(tmp_path / "q", QWEN35_CONFIG, sharded(QWEN_BODY))
    report = run(model, mtp=False)
    assert (report.mtp, report.mtp_tensors, report.arch) == (
        False,
        None,
        "Qwen3_5ForConditionalGeneration",
    )


def test_unreferenced_mtp_file_is_the_packaging_bug(tmp_path: Path) -> None:
    model = checkpoint(tmp_path / "q", QWEN35_CONFIG, sharded(QWEN_BODY))
    write_safetensors(model / "mtp.safetensors", QWEN_MTP)
    with pytest.raises(PreflightError) as caught:
        run(model)
    message = str(caught.value)
    assert "mtp.safetensors (3 MTP tensors) is not referenced" in message
    assert "silently not load" in message
    assert "packaging bug" in message
    assert "--no-mtp" in message


def test_referenced_mtp_file_passes(tmp_path: Path) -> None:
    weights = sharded(QWEN_BODY) | sharded(QWEN_MTP, "mtp.safetensors")
    model = checkpoint(tmp_path / "q", QWEN35_CONFIG, weights)
    write_safetensors(model / "mtp.safetensors", QWEN_MTP)
    assert run(model).mtp_tensors == 3


def test_stray_mtp_file_next_to_indexed_mtp_weights_is_a_warning(tmp_path: Path) -> None:
    weights = sharded(QWEN_BODY + QWEN_MTP)
    model = checkpoint(tmp_path / "q", QWEN35_CONFIG, weights)
    write_safetensors(model / "mtp.safetensors", QWEN_MTP)
    report = run(model)
    assert report.mtp_tensors == 3
    assert any("not referenced" in w for w in report.warnings)


def test_single_safetensors_header_is_read(tmp_path: Path) -> None:
    config = {"architectures": ["Qwen3NextForCausalLM"], "num_hidden_layers": 2}
    model = checkpoint(tmp_path / "n", config)
    write_safetensors(model / "model.safetensors", QWEN_BODY + QWEN_MTP[:2])
    assert run(model).mtp_tensors == 2
    write_safetensors(model / "model.safetensors", QWEN_BODY)
    with pytest.raises(PreflightError, match=r"model\.safetensors \(3 tensors, none match\)"):
        run(model)


def test_safetensors_names_skip_metadata(tmp_path: Path) -> None:
    write_safetensors(tmp_path / "x.safetensors", ["a", "b"])
    assert safetensors_names(tmp_path / "x.safetensors") == ["a", "b"]
    (tmp_path / "bad.safetensors").write_bytes(struct.pack("<Q", 4) + b"nope")
    with pytest.raises(PreflightError, match="header is not JSON"):
        safetensors_names(tmp_path / "bad.safetensors")


def test_deepseek_nextn_layer_present(tmp_path: Path) -> None:
    names = ["model.layers.2.mlp.gate.weight", "model.layers.3.eh_proj.weight",
             "model.layers.3.enorm.weight", "model.layers.30.x"]  # fmt: skip
    report = run(checkpoint(tmp_path / "d", DEEPSEEK_CONFIG, sharded(names)))
    assert (report.mtp_layout, report.mtp_tensors, report.num_hidden_layers) == (
        "nextn-layer",
        2,
        3,
    )


def test_deepseek_nextn_layer_missing(tmp_path: Path) -> None:
    names = ["model.layers.0.mlp.gate.weight", "model.layers.2.mlp.gate.weight", "lm_head.weight"]
    model = checkpoint(tmp_path / "d", DEEPSEEK_CONFIG, sharded(names))
    with pytest.raises(PreflightError, match=r"'model\.layers\.3\.\*'.*--no-mtp"):
        run(model)


def test_deepseek_without_nextn_config(tmp_path: Path) -> None:
    config = {"architectures": ["DeepseekV3ForCausalLM"], "num_hidden_layers": 3}
    model = checkpoint(tmp_path / "d", config, sharded(["model.layers.3.eh_proj.weight"]))
    with pytest.raises(PreflightError, match="no num_nextn_predict_layers.*--no-mtp"):
        run(model)


def test_unknown_arch_warns_that_mtp_cannot_be_verified(tmp_path: Path) -> None:
    model = checkpoint(tmp_path / "l", {"architectures": ["LlamaForCausalLM"]})
    report = run(model)
    assert report.mtp_tensors is None
    assert any("cannot be verified" in w for w in report.warnings)


def test_bad_config_json_names_file_and_error(tmp_path: Path) -> None:
    model = checkpoint(tmp_path / "b", '{"architectures": [')
    with pytest.raises(PreflightError, match=r"config\.json: invalid JSON: Expecting value"):
        run(model)


def test_missing_config_json(tmp_path: Path) -> None:
    (tmp_path / "empty").mkdir()
    with pytest.raises(PreflightError, match=r"config\.json: missing"):
        run(tmp_path / "empty")


def test_missing_dir_fails(tmp_path: Path) -> None:
    with pytest.raises(PreflightError, match="model directory does not exist"):
        run(tmp_path / "nope")


def test_repo_id_is_a_warning_not_a_failure() -> None:
    report = run("Qwen/Qwen3.6-27B-FP8-genfleet-test")
    assert not report.checked
    assert report.warnings == [
        "Qwen/Qwen3.6-27B-FP8-genfleet-test: not a local directory, cannot check "
        "(SGLang will fetch it)"
    ]


def test_checkpoint_arch(tmp_path: Path) -> None:
    model = checkpoint(tmp_path / "q", QWEN35_CONFIG)
    assert checkpoint_arch(str(model)) == "Qwen3_5ForConditionalGeneration"
    assert checkpoint_arch(str(tmp_path / "nope")) is None
    assert checkpoint_arch(None) is None
