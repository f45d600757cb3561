"""`genfleet run data.jsonl --regenerate` as a user runs it: ShareGPT lines whose last turn is
the old answer are refused without the flag; with it, the engine never sees an old answer, the
records keep them as `previous`, and `report` and `export` put old and new side by side."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import orjson
import pyarrow.parquet as pq
import pytest

from harness.env import ROOT, base_env
from harness.resends import sent_lines
from tests.support.commands import genfleet, invoke

pytestmark = [pytest.mark.integration, pytest.mark.slow]

EXAMPLE = ROOT / "examples/regenerate.jsonl"
ROLES = {"human": "user", "gpt": "assistant", "system": "system"}


def source_lines() -> list[dict[str, Any]]:
    return [orjson.loads(line) for line in EXAMPLE.read_bytes().splitlines()]


def test_regenerate_end_to_end_through_the_cli(tmp_path: Path, redis_url: str) -> None:
    store = (tmp_path / "store").as_uri()
    request_log = tmp_path / "requests.jsonl"
    env = base_env(redis_url, store, log_dir=tmp_path / "logs", emulator_request_log=request_log)
    lines = source_lines()

    refused = genfleet(["enqueue", str(EXAMPLE), "--run", "regen"], env, timeout_s=60)
    message = " ".join(refused.stderr.split())
    assert refused.returncode == 2, refused.stdout + refused.stderr
    assert f"{EXAMPLE}:1 [conversations[-1]]: ends with an assistant answer: pass --regenerate" in (
        message
    )
    assert f"{len(lines)} lines end with an assistant answer" in message
    assert not request_log.exists()  # nothing reached an engine

    # The same run name, now with --regenerate: the refusal left nothing that binds it.
    result = genfleet(
        ["run", str(EXAMPLE), "--run", "regen", "--regenerate", "--batch-size", "8"], env
    )
    assert result.returncode == 0, result.stdout + result.stderr

    old = {line["id"]: line["conversations"][-1]["value"] for line in lines}
    sent: dict[str, list[dict[str, Any]]] = {}
    for entry in sent_lines(request_log):
        body = entry["body"]
        messages = body["messages"]
        assert messages[-1]["role"] != "assistant", messages
        raw = orjson.dumps(body).decode()
        assert not any(answer in raw for answer in old.values() if len(answer) > 8), raw
        sent[messages[-1]["content"]] = messages
    for line in lines:  # each prompt was sent as its conversation less the old answer
        turns = [{"role": ROLES[t["from"]], "content": t["value"]} for t in line["conversations"]]
        assert sent[turns[-2]["content"]] == turns[:-1]

    out = tmp_path / "out.jsonl"
    assert genfleet(["export", "regen", "--out", str(out)], env).returncode == 0
    rows = [orjson.loads(line) for line in out.read_bytes().splitlines()]
    assert [r["id"] for r in rows] == [line["id"] for line in lines]
    for row in rows:
        reasoning, _, content = old[row["id"]].partition("</think>")
        expected = (
            {"content": content.lstrip(), "reasoning": reasoning.removeprefix("<think>")}
            if content
            else {"content": old[row["id"]], "reasoning": None}
        )
        assert row["previous"] == expected
        assert row["error"] is None and row["content"]
        assert row["messages"][-1]["role"] == "user"

    parquet = tmp_path / "out.parquet"
    assert (
        genfleet(["export", "regen", "--out", str(parquet), "--format", "parquet"], env).returncode
        == 0
    )
    table = pq.read_table(parquet)
    assert table.column("previous").to_pylist() == [r["previous"] for r in rows]
    bare = tmp_path / "bare.jsonl"
    assert genfleet(["export", "regen", "--out", str(bare), "--no-previous"], env).returncode == 0
    assert all("previous" not in orjson.loads(line) for line in bare.read_bytes().splitlines())
    bare_parquet = tmp_path / "bare.parquet"
    exported = genfleet(
        ["export", "regen", "--out", str(bare_parquet), "--format", "parquet", "--no-previous"], env
    )
    assert exported.returncode == 0
    assert "previous" not in pq.read_table(bare_parquet).column_names

    reported = genfleet(["report", "regen", "--json"], env)
    assert reported.returncode == 0, reported.stderr
    previous = orjson.loads(reported.stdout)["previous"]
    short = sum(
        1 for answer in old.values() if len(answer.partition("</think>")[2].strip() or answer) < 32
    )
    assert previous["count"] == len(lines)
    assert previous["short_fraction"] == round(short / len(lines), 4)
    assert previous["content_chars"]["previous"]["max"] < previous["content_chars"]["new"]["max"]
    table_text = genfleet(["report", "regen"], env).stdout
    assert "previous vs new" in table_text


def test_enqueue_says_how_many_lines_end_with_an_answer_and_stages_the_rest(
    tmp_path: Path, redis_url: str
) -> None:
    source = tmp_path / "mixed.jsonl"
    rows = [
        {"prompt": "fine"},
        {"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]},
        {"conversations": [{"from": "human", "value": "q"}, {"from": "gpt", "value": "a"}]},
    ]
    source.write_bytes(b"".join(orjson.dumps(r) + b"\n" for r in rows))
    env = {"GENFLEET_REDIS_URL": redis_url, "GENFLEET_STORE": (tmp_path / "store").as_uri()}
    result = invoke("enqueue", str(source), "--run", "mixed", env=env)
    message = " ".join(result.output.split())
    assert result.exit_code == 0, result.output
    assert "staged 1 prompt" in message and "rejected 2 lines" in message
    assert f"{source}:2 [messages[-1]]: ends with an assistant answer" in message
    assert f"{source}:3 [conversations[-1]]: ends with an assistant answer" in message
    assert "2 lines end with an assistant answer" in message and "--regenerate" in message
    rejects = (tmp_path / "store/mixed/rejects.jsonl").read_bytes().splitlines()
    assert [orjson.loads(r)["field"] for r in rejects] == ["messages[-1]", "conversations[-1]"]

    as_json = invoke("enqueue", str(source), "--run", "mixed2", "--json", env=env)
    assert orjson.loads(as_json.stdout)["ends_with_answer"] == 2


def test_regenerate_is_part_of_the_run_identity(tmp_path: Path, redis_url: str) -> None:
    source = tmp_path / "p.jsonl"
    answered = [{"role": "user", "content": "a"}, {"role": "assistant", "content": "old"}]
    rows = [{"messages": answered}, {"prompt": "b"}]
    source.write_bytes(b"".join(orjson.dumps(r) + b"\n" for r in rows))
    env = {"GENFLEET_REDIS_URL": redis_url, "GENFLEET_STORE": (tmp_path / "store").as_uri()}
    assert invoke("enqueue", str(source), "--run", "r", "--regenerate", env=env).exit_code == 0
    manifest = orjson.loads((tmp_path / "store/r/manifest.json").read_bytes())
    assert manifest["staging"]["regenerate"] is True
    refused = invoke("enqueue", str(source), "--run", "r", env=env)
    assert refused.exit_code == 2, refused.output
    assert "regenerate: the run has True" in " ".join(refused.output.split())
    assert invoke("enqueue", str(source), "--run", "r", "--regenerate", env=env).exit_code == 0
