"""The engine's API key travels in its --config file, which SGLang (and the emulator) turn into
argv: a key beginning with '-' would be read as the next flag and the engine would not start."""

from __future__ import annotations

import re

import pytest
from pydantic import ValidationError

from genfleet.common.settings import Settings
from genfleet.workers.engine.kinds import with_engine_key


def test_a_generated_key_never_reads_as_a_flag() -> None:
    keys = {with_engine_key(Settings()).engine_api_key.get_secret_value() for _ in range(300)}  # type: ignore[union-attr]
    assert len(keys) == 300
    assert all(re.fullmatch(r"[0-9a-f]{64}", key) for key in keys), sorted(keys)[:3]


def test_a_key_beginning_with_a_dash_is_refused_naming_why() -> None:
    with pytest.raises(ValidationError, match="engine_api_key"):
        Settings(engine_api_key="-starts-like-a-flag")
    assert Settings(engine_api_key="fine-key").engine_api_key is not None


def test_a_command_engine_gets_a_key_of_its_own_and_an_external_one_none() -> None:
    made = with_engine_key(Settings(engine="command", engine_command="serve --port {port}"))
    assert made.engine_api_key is not None
    external = with_engine_key(Settings(engine="external", engine_url="http://10.0.0.2:30000"))
    assert external.engine_api_key is None
