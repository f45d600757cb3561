from __future__ import annotations

from pathlib import Path

import pytest
from pydantic import ValidationError

from genfleet.common.settings import Settings, redact_url, setting_names


def test_environment_prefix_and_same_names(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("GENFLEET_MAX_INFLIGHT", "17")
    monkeypatch.setenv("GENFLEET_MTP", "false")
    settings = Settings()
    assert settings.max_inflight == 17
    assert settings.mtp is False
    # a CLI flag of the same name wins over the environment
    assert Settings.from_overrides({"max_inflight": "5"}).max_inflight == 5


def test_engine_kind_defaults_to_emulator_without_a_model() -> None:
    assert Settings().engine_kind == "emulator"
    assert Settings(model="/models/x").engine_kind == "sglang"
    assert Settings(engine="external", engine_url="http://127.0.0.1:1").engine_kind == "external"
    with pytest.raises(ValidationError, match="engine-url"):
        Settings(engine="external")
    with pytest.raises(ValidationError, match="engine-command"):
        Settings(engine="command")


def test_store_urls() -> None:
    assert Settings(store="s3://bucket/prefix").store == "s3://bucket/prefix"
    assert Settings(store="/tmp/x").store == "file:///tmp/x"
    with pytest.raises(ValidationError, match="store must be"):
        Settings(store="gs://bucket")


def test_secrets_never_in_repr_or_redacted() -> None:
    settings = Settings(redis_url="redis://:hunter2@redis:6379/0", engine_api_key="sk-secret")
    assert "hunter2" not in repr(settings)
    assert "sk-secret" not in repr(settings)
    redacted = settings.redacted()
    assert redacted["redis_url"] == "redis://:***@redis:6379/0"
    assert redacted["engine_api_key"] == "**********"
    # processes this one starts do get the real values
    assert settings.child_env()["GENFLEET_REDIS_URL"] == "redis://:hunter2@redis:6379/0"


@pytest.mark.parametrize(
    ("url", "expected"),
    [
        ("redis://127.0.0.1:6379/0", "redis://127.0.0.1:6379/0"),
        ("redis://:pw@h:1/0", "redis://:***@h:1/0"),
        ("redis://user:pw@h:1/0", "redis://user:***@h:1/0"),
    ],
)
def test_redact_url(url: str, expected: str) -> None:
    assert redact_url(url) == expected


def test_setting_names_have_units_for_times() -> None:
    names = setting_names()
    assert "GENFLEET_REDIS_URL" in names and "GENFLEET_EMULATOR_TIME_SCALE" in names
    for field in Settings.model_fields:
        if "timeout" in field or "interval" in field or "ttl" in field:
            assert field.endswith("_s"), field


def test_settings_file_sits_between_environment_and_flags(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    tuned = tmp_path / "tuned.env"
    tuned.write_text(
        "# written by genfleet tune\n"
        "\n"
        "GENFLEET_MTP=false\n"
        "export GENFLEET_MAX_RUNNING_REQUESTS=48\n"
        "GENFLEET_MAX_INFLIGHT='64'  # a trailing comment\n"
        'GENFLEET_SYSTEM_PROMPT="be brief"\n'
        'GENFLEET_ENGINE_EXTRA_ARGS="--foo #bar"  # the # inside quotes is the value\'s\n'
        "GENFLEET_REASONING_PARSER='deepseek-r1' # a comment after a quoted value\n"
    )
    monkeypatch.setenv("GENFLEET_MAX_INFLIGHT", "17")
    monkeypatch.setenv("GENFLEET_BATCH_SIZE", "9")
    overrides = {"settings_file": str(tuned), "max_running_requests": "96"}
    settings = Settings.from_overrides(overrides)
    assert settings.mtp is False  # from the file
    assert settings.max_inflight == 64  # the file wins over the environment
    assert settings.max_running_requests == 96  # a flag wins over the file
    assert settings.batch_size == 9  # the environment still fills what the file leaves
    assert settings.system_prompt == "be brief"
    assert settings.engine_extra_args == "--foo #bar"
    assert settings.reasoning_parser == "deepseek-r1"


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("GENFLEET_NO_SUCH=1\n", ":1: expected GENFLEET_NAME=VALUE"),
        ("# ok\nMTP=true\n", ":2: expected GENFLEET_NAME=VALUE"),
        ("GENFLEET_MTP\n", ":1: expected"),
        ("GENFLEET_MTP=true\n\n# c\nGENFLEET_SYSTEM_PROMPT='unclosed\n", ":4: expected"),
    ],
)
def test_settings_file_errors_name_the_line(tmp_path: Path, text: str, message: str) -> None:
    bad = tmp_path / "bad.env"
    bad.write_text(text)
    with pytest.raises(ValueError, match=message):
        Settings.from_overrides({"settings_file": str(bad)})
    with pytest.raises(ValueError, match="no such file|No such file"):
        Settings.from_overrides({"settings_file": str(tmp_path / "missing.env")})
