"""The run-level request flags become the run's recorded parameters, or a clear refusal."""

from __future__ import annotations

from pathlib import Path

import pytest
from pydantic import ValidationError

from genfleet.common.errors import ConfigError
from genfleet.common.settings import Settings
from genfleet.producer.enqueue import generation_params


def test_unset_flags_send_nothing() -> None:
    params = generation_params(Settings())
    assert (params.top_k, params.min_p, params.repetition_penalty) == (None, None, None)
    assert (params.response_format, params.chat_template_kwargs) == (None, None)


def test_flags_are_recorded_with_the_schema_itself(tmp_path: Path) -> None:
    schema = tmp_path / "my answer.json"
    schema.write_text('{"type": "object", "required": ["a"]}')
    settings = Settings(
        top_k=20,
        min_p=0.1,
        repetition_penalty=1.1,
        json_schema=str(schema),
        chat_template_kwargs='{"enable_thinking": false}',
    )
    params = generation_params(settings)
    assert (params.top_k, params.min_p, params.repetition_penalty) == (20, 0.1, 1.1)
    assert params.response_format == {
        "type": "json_schema",
        "json_schema": {"name": "my_answer", "schema": {"type": "object", "required": ["a"]}},
    }
    assert params.chat_template_kwargs == {"enable_thinking": False}


@pytest.mark.parametrize(
    ("content", "message"),
    [(None, "No such file"), ("[1, 2]", "must be a JSON object"), ("{nope", "not JSON")],
)
def test_a_bad_schema_file_is_refused(tmp_path: Path, content: str | None, message: str) -> None:
    path = tmp_path / "schema.json"
    if content is not None:
        path.write_text(content)
    with pytest.raises(ConfigError, match=message):
        generation_params(Settings(json_schema=str(path)))


@pytest.mark.parametrize("value", ["false", "[1]"])
def test_chat_template_kwargs_must_be_an_object(value: str) -> None:
    with pytest.raises(ValidationError, match="JSON object"):
        Settings(chat_template_kwargs=value)
    with pytest.raises(ConfigError, match="not JSON"):
        generation_params(Settings(chat_template_kwargs="{oops"))


@pytest.mark.parametrize(("flag", "thinking"), [("--thinking", True), ("--no-thinking", False)])
def test_enqueue_takes_the_run_flags_from_the_settings_model(
    tmp_path: Path, redis_url: str, flag: str, thinking: bool
) -> None:
    import orjson
    from typer.testing import CliRunner

    from genfleet.cli import app
    from genfleet.common.manifest import Manifest
    from genfleet.common.store import open_store

    source = tmp_path / "p.jsonl"
    source.write_bytes(b'{"prompt": "a"}\n{"prompt": "b"}\n')
    store_url = (tmp_path / "store").as_uri()
    args = ["enqueue", str(source), "--run", "r", flag, "--top-k", "20", "--max-tokens", "64"]
    args += ["--min-p", "0.1", "--redis-url", redis_url, "--store", store_url, "--json"]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    assert orjson.loads(result.stdout)["queue"] == "gpu.emulator"
    manifest = Manifest.load(open_store(store_url), "r")
    assert manifest is not None
    recorded = manifest.params
    assert (recorded.thinking, recorded.top_k, recorded.min_p, recorded.max_tokens) == (
        thinking,
        20,
        0.1,
        64,
    )
