"""Checkpoint directories holding the published chat templates of tests/data/chat_templates/."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

TEMPLATES = Path(__file__).resolve().parents[1] / "data" / "chat_templates"
# DeepSeek's tokenizer_config.json names its BOS and EOS (its template reads them).
DEEPSEEK = {"bos_token": "<｜begin▁of▁sentence｜>", "eos_token": "<｜end▁of▁sentence｜>"}


def checkpoint(root: Path, template: str, config: dict[str, Any] | None = None) -> str:
    """A model directory holding a published template as chat_template.jinja."""
    model = root / template
    model.mkdir()
    shutil.copy(TEMPLATES / f"{template}.jinja", model / "chat_template.jinja")
    if config is not None:
        (model / "tokenizer_config.json").write_text(json.dumps(config))
    return str(model)
