"""The one architecture table: checkpoint → family → reasoning parser, thinking switch, MTP
layout and mamba flags; settings override each; an unreadable architecture on an old SGLang
is refused with the setting to pass."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from genfleet.common.errors import ConfigError
from genfleet.common.settings import Settings
from genfleet.workers.engine import families, preflight
from genfleet.workers.engine.families import choose, family_from_name, family_of
from genfleet.workers.engine.kinds import print_engine_command
from genfleet.workers.engine.sglang_argv import sglang_launch


@pytest.mark.parametrize(
    ("arch", "model", "parser", "key", "default"),
    [
        ("Qwen3ForCausalLM", "/m/Qwen3-8B", "qwen3", "enable_thinking", True),
        ("Qwen3_5ForConditionalGeneration", "/m/Qwen3.6-27B", "qwen3", "enable_thinking", True),
        ("Qwen3NextForCausalLM", "/m/q", "qwen3", "enable_thinking", True),
        ("DeepseekV3ForCausalLM", "/m/DeepSeek-V3.1", "deepseek-v3", "thinking", False),
        ("DeepseekV32ForCausalLM", "/m/DeepSeek-V3.2-Exp", "deepseek-v3", "thinking", False),
        ("DeepseekV3ForCausalLM", "/m/DeepSeek-R1-0528", "deepseek-r1", None, True),
        ("LlamaForCausalLM", "/m/Llama-3.1-8B", None, "enable_thinking", True),
    ],
)
def test_the_family_decides_parser_and_switch(
    arch: str, model: str, parser: str | None, key: str | None, default: bool
) -> None:
    choice = choose(Settings(model=model), arch)
    assert (choice.reasoning_parser, choice.thinking_key, choice.thinking_default) == (
        parser,
        key,
        default,
    )
    assert choice.source == "config.json"


@pytest.mark.parametrize(
    ("overrides", "parser", "key", "default"),
    [
        ({"reasoning_parser": "qwen3-thinking"}, "qwen3-thinking", "thinking", False),
        ({"reasoning_parser": "none"}, None, "thinking", False),
        ({"thinking_switch": "enable_thinking"}, "deepseek-v3", "enable_thinking", None),
        ({"thinking_switch": "none"}, "deepseek-v3", None, None),
        ({"model_architecture": "Qwen3ForCausalLM"}, "qwen3", "enable_thinking", True),
    ],
)
def test_settings_override_each_choice(
    overrides: dict[str, Any], parser: str | None, key: str | None, default: bool | None
) -> None:
    settings = Settings(model="/m/DeepSeek-V3.1", **overrides)
    choice = choose(settings, "DeepseekV3ForCausalLM")
    assert (choice.reasoning_parser, choice.thinking_key, choice.thinking_default) == (
        parser,
        key,
        default,
    )


@pytest.mark.parametrize(
    ("name", "family"),
    [
        ("Qwen/Qwen3.6-35B-A3B-FP8", "qwen3.5"),
        ("Qwen/Qwen3-Next-80B-A3B-Instruct", "qwen3.5"),
        ("Qwen/Qwen3-32B", "qwen3"),
        ("deepseek-ai/DeepSeek-R1-0528", "deepseek-r1"),
        ("deepseek-ai/DeepSeek-V3.1", "deepseek-v3"),
        ("meta-llama/Llama-3.1-8B", None),
    ],
)
def test_a_hub_id_is_guessed_from_its_name(name: str, family: str | None) -> None:
    found = family_from_name(name)
    assert (found.name if found else None) == family
    if family:
        assert choose(Settings(model=name), None).source == "name"


def test_the_emulator_plays_a_qwen3_model() -> None:
    choice = choose(Settings(), None)
    assert (choice.family, choice.reasoning_parser) == (families.QWEN3, "qwen3")


def test_preflight_and_argv_read_the_same_table() -> None:
    for arch, family in families.ARCHITECTURES.items():
        assert preflight.mtp_layout(arch, {}) == family.mtp_layout
        assert (arch in families.HYBRID_ARCHS) == family.hybrid
    assert family_of("DeepseekV3ForCausalLM", "/x/DeepSeek-R1") is families.DEEPSEEK_R1


@pytest.mark.parametrize("version", ["0.5.11", "0.5.13.post1"])
def test_an_unreadable_architecture_on_an_old_sglang_is_refused(version: str) -> None:
    with pytest.raises(ConfigError, match="--model-architecture") as info:
        sglang_launch(Settings(model="Qwen/Qwen3.6-27B"), 30001, version, arch=None)
    assert "--no-mtp" in str(info.value)


def test_print_engine_command_names_the_family_of_a_checkpoint(tmp_path: Path) -> None:
    model = tmp_path / "DeepSeek-V3.1"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({"architectures": ["DeepseekV3ForCausalLM"]}))
    text = print_engine_command(Settings(model=str(model), sglang_version="0.5.11"))
    assert "--reasoning-parser deepseek-v3" in text
    assert (
        "# model family deepseek-v3 (architecture DeepseekV3ForCausalLM, from config.json)" in text
    )
    assert "thinking switch chat_template_kwargs.thinking (template default off)" in text

    settings = Settings(model=str(model), sglang_version="0.5.11", reasoning_parser="deepseek-r1")
    assert "--reasoning-parser deepseek-r1" in print_engine_command(settings)
