from __future__ import annotations

import pytest
from pydantic import ValidationError

from common.settings import Settings, parse_setting_args, redact_url, setting_names


def test_environment_prefix_and_same_names(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("GENFLEET_MAX_INFLIGHT", "17")
    monkeypatch.setenv("GENFLEET_MTP", "false")
    settings = Settings()
    assert settings.max_inflight == 17
    assert settings.mtp is False
    # a CLI flag of the same name wins over the environment
    assert Settings.from_overrides(parse_setting_args(["--max-inflight", "5"])).max_inflight == 5


@pytest.mark.parametrize(
    ("args", "expected"),
    [
        (["--max-inflight", "8"], {"max_inflight": "8"}),
        (["--max-inflight=8"], {"max_inflight": "8"}),
        (["--no-mtp"], {"mtp": False}),
        (["--trust-remote-code"], {"trust_remote_code": True}),
        (["--thinking=false"], {"thinking": "false"}),
        (["--store", "s3://b/p", "--tp-size", "2"], {"store": "s3://b/p", "tp_size": "2"}),
    ],
)
def test_parse_setting_args(args: list[str], expected: dict[str, object]) -> None:
    assert parse_setting_args(args) == expected


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--no-such-thing", "1"], "unknown option --no-such-thing"),
        (["--max-inflight"], "needs a value"),
        (["positional"], "unexpected argument"),
    ],
)
def test_parse_setting_args_errors(args: list[str], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        parse_setting_args(args)


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
