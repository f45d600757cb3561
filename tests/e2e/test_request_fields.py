"""Every request field arrives, or the line is refused: an OpenAI Batch file and the run-level
flags go through `genfleet enqueue`, a real worker and the emulator, whose request log says
what each request carried.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import orjson
import pytest
import redis

from genfleet.common.manifest import Manifest
from genfleet.common.store import open_store
from genfleet.producer.status import run_status
from harness.env import base_env
from harness.processes import Worker
from harness.resends import sent_lines
from harness.waits import wait_for
from tests.support.commands import invoke

pytestmark = [pytest.mark.integration, pytest.mark.slow]

SCHEMA = {"type": "object", "properties": {"answer": {"type": "string"}}}
LINE_FIELDS: dict[str, Any] = {
    "max_completion_tokens": 200,
    "temperature": 0.3,
    "top_p": 0.9,
    "top_k": 5,
    "min_p": 0.1,
    "repetition_penalty": 1.2,
    "presence_penalty": 0.5,
    "frequency_penalty": 0.25,
    "seed": 11,
    "stop": ["END"],
    "response_format": {"type": "json_object"},
    "logprobs": True,
    "top_logprobs": 2,
    "chat_template_kwargs": {"enable_thinking": False},
}


def batch_line(custom_id: str, **body: Any) -> bytes:
    line = {
        "custom_id": custom_id,
        "method": "POST",
        "url": "/v1/chat/completions",
        "body": {
            "model": "gpt-x",
            "stream": True,
            "messages": [{"role": "user", "content": custom_id}],
            **body,
        },
    }
    return orjson.dumps(line) + b"\n"


def test_every_field_reaches_the_engine_and_an_unsupported_one_is_a_reject(
    tmp_path: Path,
    redis_url: str,
    redis_client: redis.Redis,
    start_worker: Callable[..., Worker],
) -> None:
    source = tmp_path / "batch.jsonl"
    source.write_bytes(
        batch_line("all-fields", **LINE_FIELDS)
        + batch_line("run-level")
        + batch_line("two-samples", n=2, seed=3)
        + batch_line("with-tools", tools=[{"type": "function", "function": {"name": "f"}}])
    )
    schema_file = tmp_path / "answer.schema.json"
    schema_file.write_text(orjson.dumps(SCHEMA).decode())
    store_url = (tmp_path / "store").as_uri()
    request_log = tmp_path / "requests.jsonl"
    worker = start_worker(base_env(redis_url, store_url, emulator_request_log=request_log))
    flags = ["--redis-url", redis_url, "--store", store_url, "--max-tokens", "300"]
    flags += ["--top-k", "40", "--min-p", "0.02", "--repetition-penalty", "1.05"]
    flags += ["--json-schema", str(schema_file), "--chat-template-kwargs", '{"custom": 7}']
    result = invoke("enqueue", str(source), "--run", "fields", *flags)
    assert result.exit_code == 0, result.output
    output = " ".join(result.output.split())
    assert "rejected 1 line;" in output
    assert "batch.jsonl:4 [body.tools]" in output

    store = open_store(store_url)
    manifest = Manifest.load(store, "fields")
    assert manifest is not None
    run_format = {"type": "json_schema", "json_schema": {"name": "answer", "schema": SCHEMA}}
    recorded = manifest.params.model_dump()
    assert (recorded["top_k"], recorded["min_p"], recorded["repetition_penalty"]) == (
        40,
        0.02,
        1.05,
    )
    assert recorded["response_format"] == run_format
    assert recorded["chat_template_kwargs"] == {"custom": 7}

    worker.wait_ready()
    wait_for(
        lambda: run_status(store, redis_client, "fields")["state"] == "done", 60, "the run", 0.3
    )
    bodies = {}
    for entry in sent_lines(request_log):
        body = entry["body"]
        bodies.setdefault(body["messages"][0]["content"], []).append(body)

    (own,) = bodies["all-fields"]
    merged = {"max_completion_tokens", "chat_template_kwargs"}  # checked below
    expected = {k: v for k, v in LINE_FIELDS.items() if k not in merged}
    assert {k: own[k] for k in expected} == expected  # the line's own fields win
    assert own["max_tokens"] == 200
    assert own["chat_template_kwargs"] == {"custom": 7, "enable_thinking": False}
    # the line's own stream fields are dropped: genfleet streams every answer its own way
    assert own["stream_options"] == {"include_usage": True, "continuous_usage_stats": True}
    assert own["model"] != "gpt-x"

    (run_level,) = bodies["run-level"]
    assert (run_level["top_k"], run_level["min_p"], run_level["repetition_penalty"]) == (
        40,
        0.02,
        1.05,
    )
    assert (run_level["max_tokens"], run_level["response_format"]) == (300, run_format)
    assert run_level["chat_template_kwargs"] == {"custom": 7}

    assert sorted(b["seed"] for b in bodies["two-samples"]) == [3, 4]
    assert all("n" not in b for b in bodies["two-samples"])
    assert "with-tools" not in bodies
