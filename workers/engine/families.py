"""Model families: the one architecture table the argv builder, preflight and client read.

A checkpoint's `architectures[0]` (config.json) decides what SGLang and the chat template
need: where MTP weights live (preflight), whether MTP needs the mamba `extra_buffer` cache
(the argv builder), the reasoning parser, and which `chat_template_kwargs` key switches
thinking (the client). The wrong parser is silently wrong: `qwen3` on a DeepSeek V3.x
checkpoint puts the whole answer into `reasoning_content` and leaves `content` empty.

| family      | architectures                                    | parser      | switch          |
|-------------|--------------------------------------------------|-------------|-----------------|
| qwen3       | Qwen3ForCausalLM, Qwen3MoeForCausalLM            | qwen3       | enable_thinking |
| qwen3.5     | Qwen3Next…, Qwen3_5… (hybrid GDN, MTP in `mtp.*`) | qwen3       | enable_thinking |
| deepseek-v3 | DeepseekV3ForCausalLM, DeepseekV32ForCausalLM    | deepseek-v3 | thinking        |
| deepseek-r1 | DeepseekV3ForCausalLM named …R1…                 | deepseek-r1 | (always thinks) |

R1 and V3.x share an architecture; the checkpoint's name tells them apart. Settings override
each choice (`reasoning_parser`, `thinking_switch`, `model_architecture`).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import PurePath
from typing import Literal

from genfleet.common.settings import Settings

MtpLayout = Literal["mtp-names", "nextn-layer"]
NONE = "none"  # a setting's way to say "no parser" / "no switch"


@dataclass(frozen=True, slots=True)
class Family:
    """What one model family needs from SGLang and its chat template."""

    name: str
    reasoning_parser: str | None
    thinking_key: str | None  # the chat_template_kwargs key; None: no switch
    thinking_default: bool  # what the template does when the switch is not sent
    mtp_layout: MtpLayout | None  # where preflight looks for MTP weights
    hybrid: bool = False  # GDN + mamba state: MTP needs the extra_buffer mamba cache


QWEN3 = Family("qwen3", "qwen3", "enable_thinking", True, None)
QWEN_HYBRID = Family("qwen3.5", "qwen3", "enable_thinking", True, "mtp-names", hybrid=True)
DEEPSEEK_V3 = Family("deepseek-v3", "deepseek-v3", "thinking", False, "nextn-layer")
DEEPSEEK_R1 = Family("deepseek-r1", "deepseek-r1", None, True, "nextn-layer")

# `architectures[0]` → family. Qwen3.6 checkpoints load through the Qwen3.5 classes; the
# hybrid ones are SGLang's `_MAMBA_EXTRA_BUFFER_ARCHS` (`arg_groups/overrides.py`).
ARCHITECTURES: dict[str, Family] = {
    "Qwen3ForCausalLM": QWEN3,
    "Qwen3MoeForCausalLM": QWEN3,
    "Qwen3NextForCausalLM": QWEN_HYBRID,
    "Qwen3_5ForConditionalGeneration": QWEN_HYBRID,
    "Qwen3_5MoeForConditionalGeneration": QWEN_HYBRID,
    "Qwen3_5ForCausalLM": QWEN_HYBRID,
    "Qwen3_5MoeForCausalLM": QWEN_HYBRID,
    "DeepseekV3ForCausalLM": DEEPSEEK_V3,
    "DeepseekV32ForCausalLM": DEEPSEEK_V3,
}
HYBRID_ARCHS = frozenset(arch for arch, family in ARCHITECTURES.items() if family.hybrid)

_R1 = re.compile(r"(?:^|[^a-z0-9])r1(?:[^a-z0-9]|$)")
# Only for a checkpoint whose config cannot be read (a hub id): its name, most specific first.
_NAME_HINTS: tuple[tuple[re.Pattern[str], Family], ...] = (
    (re.compile(r"qwen3[._-]?(5|6|next)"), QWEN_HYBRID),
    (re.compile(r"qwen3"), QWEN3),
    (re.compile(r"deepseek.*v3"), DEEPSEEK_V3),
)


def family_of(arch: str | None, model: str | None = None) -> Family | None:
    """The family of an architecture (R1 told from V3.x by the checkpoint's name)."""
    family = ARCHITECTURES.get(arch or "")
    name = PurePath(model).name.lower() if model else ""
    if family is DEEPSEEK_V3 and _R1.search(name):
        return DEEPSEEK_R1
    return family


def family_from_name(model: str | None) -> Family | None:
    """A guess from a hub id or directory name, when no config.json could be read."""
    name = (model or "").lower()
    if "deepseek" in name and _R1.search(PurePath(name).name):
        return DEEPSEEK_R1
    for pattern, family in _NAME_HINTS:
        if pattern.search(name):
            return family
    return None


@dataclass(frozen=True, slots=True)
class ModelChoice:
    """What a worker runs a checkpoint with, and where each choice came from."""

    arch: str | None
    family: Family | None
    reasoning_parser: str | None
    thinking_key: str | None
    thinking_default: bool | None  # None: the key was set by hand, always send it
    source: str  # "config.json", "--model-architecture", "name", "emulator", "unknown"

    def describe(self) -> str:
        """One comment line for `--print-engine-command`."""
        family = self.family.name if self.family else "unknown"
        if self.thinking_key is None:
            switch = "none"
        elif self.thinking_default is None:
            switch = f"chat_template_kwargs.{self.thinking_key} (always sent)"
        else:
            state = "on" if self.thinking_default else "off"
            switch = f"chat_template_kwargs.{self.thinking_key} (template default {state})"
        return (
            f"# model family {family} (architecture {self.arch or 'unknown'}, from "
            f"{self.source}); reasoning parser {self.reasoning_parser or 'none'}; "
            f"thinking switch {switch}"
        )


def choose(settings: Settings, read_arch: str | None) -> ModelChoice:
    """The family and its choices for these settings and the architecture read from disk.

    `--model-architecture` wins over config.json; with neither, the name is a guess (never
    for the mamba flags: see `sglang_argv`). The emulator plays Qwen3 unless told otherwise.
    """
    arch = settings.model_architecture or read_arch
    if settings.model_architecture:
        source = "--model-architecture"
    elif read_arch:
        source = "config.json"
    else:
        source = "unknown"
    family = family_of(arch, settings.model)
    if family is None and arch is None:
        family = family_from_name(settings.model)
        source = "name" if family else source
    if family is None and settings.engine_kind == "emulator":
        family, source = QWEN3, "emulator"
    parser = settings.reasoning_parser or (family.reasoning_parser if family else None)
    if settings.thinking_switch:
        key = None if settings.thinking_switch == NONE else settings.thinking_switch
        default: bool | None = None
    elif family is not None:
        key, default = family.thinking_key, family.thinking_default
    else:
        key, default = "enable_thinking", True  # what OpenAI-compatible servers mostly read
    return ModelChoice(
        arch=arch,
        family=family,
        reasoning_parser=None if parser == NONE else parser,
        thinking_key=key,
        thinking_default=default,
        source=source,
    )
