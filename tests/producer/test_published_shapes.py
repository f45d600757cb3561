"""Published training sets as they are (tests/data, sources in its README), staged through
the producer: the staged request of a known record carries exactly the system turn, the prompt
and the old answer the set holds."""

from __future__ import annotations

import gzip
from pathlib import Path
from typing import Any

import orjson
import pytest

from genfleet.common import keys
from genfleet.common.errors import InputError
from genfleet.common.readers import ReaderOptions
from genfleet.common.records import WorkOrder
from genfleet.common.settings import Settings
from genfleet.producer import enqueue
from genfleet.producer.enqueue import EnqueueResult
from tests.fakes.memory_store import MemoryStore

DATA = Path(__file__).resolve().parents[1] / "data"
RUN = "published"


def stage(tmp_path: Path, name: str, **options: Any) -> tuple[dict[str, Any], EnqueueResult]:
    """The staged records of `tests/data/NAME` by id, and what enqueue said of it."""
    reader = ReaderOptions(**options)
    settings = Settings(regenerate=reader.regenerate, store=str(tmp_path / "unused"))
    store = MemoryStore()

    def send(orders: list[WorkOrder]) -> int:
        return len(orders)

    manifest, result = enqueue.stage(settings, store, RUN, str(DATA / name), reader, send, set())
    staged: dict[str, Any] = {}
    for index in range(manifest.batches_total):
        raw = gzip.decompress(store.objects[keys.input_key(RUN, keys.batch_id(index))])
        for line in raw.splitlines():
            record = orjson.loads(line)
            staged[record["id"]] = record
    return staged, result


def published(name: str) -> list[dict[str, Any]]:
    raw = (DATA / name).read_bytes()
    if name.endswith(".json"):
        rows: list[dict[str, Any]] = orjson.loads(raw)
        return rows
    return [orjson.loads(line) for line in raw.splitlines() if line.strip()]


def user(text: str) -> dict[str, str]:
    return {"role": "user", "content": text}


def turns(conversation: list[dict[str, str]]) -> list[dict[str, str]]:
    roles = {"human": "user", "gpt": "assistant"}
    return [{"role": roles[turn["from"]], "content": turn["value"]} for turn in conversation]


def test_alpaca_stages_instruction_and_input_and_keeps_output(tmp_path: Path) -> None:
    staged, result = stage(tmp_path, "alpaca_data.sample.json", regenerate=True)
    rows = published("alpaca_data.sample.json")
    assert len(staged) == len(rows) and result.rejects == 0
    for number, row in enumerate(rows, start=1):
        record = staged[f"alpaca_data.sample.json:{number}"]
        prompt = row["instruction"] + (f"\n\n{row['input']}" if row["input"].strip() else "")
        assert record["messages"] == [user(prompt)]
        assert record["previous"] == {"content": row["output"], "reasoning": None}
    [said] = result.read_as
    assert "read as Alpaca" in said and "old answer `output` (kept with --regenerate)" in said


def test_dolly_stages_instruction_and_context_and_keeps_response(tmp_path: Path) -> None:
    staged, result = stage(tmp_path, "dolly.sample.jsonl", regenerate=True)
    rows = published("dolly.sample.jsonl")
    assert len(staged) == len(rows) == 4 and result.rejects == 0
    first = staged["dolly.sample.jsonl:1"]  # Virgin Australia: a context to read
    assert first["messages"] == [user(f"{rows[0]['instruction']}\n\n{rows[0]['context']}")]
    assert first["previous"]["content"] == rows[0]["response"]
    second = staged["dolly.sample.jsonl:2"]  # an empty context adds nothing
    assert second["messages"] == [user("Which is a species of fish? Tope or Rope")]
    assert second["previous"]["content"] == "Tope"
    assert "read as Dolly" in result.read_as[0]


def test_openorca_stages_question_with_its_system_prompt(tmp_path: Path) -> None:
    [row] = published("openorca.sample.jsonl")
    staged, result = stage(tmp_path, "openorca.sample.jsonl", regenerate=True)
    record = staged["niv.242684"]
    assert record["messages"] == [user(row["question"])]  # its system_prompt is empty
    assert record["previous"]["content"] == row["response"]
    assert "read as OpenOrca" in result.read_as[0]
    # The same row with --system-col naming the column: an empty one is still no turn, and
    # the row's system prompt, when the set has one, comes first.
    staged, _ = stage(tmp_path, "openorca.sample.jsonl", regenerate=True, system_col="id")
    assert staged["niv.242684"]["messages"] == [
        {"role": "system", "content": "niv.242684"},
        user(row["question"]),
    ]


def test_sharegpt_with_a_top_level_system_stages_it_first(tmp_path: Path) -> None:
    name = "dummy_conversation_with_system.sample.json"
    rows = published(name)
    staged, result = stage(tmp_path, name, regenerate=True)
    assert len(staged) == len(rows) == 8 and result.rejects == 0
    for row in rows:
        record = staged[row["id"]]
        *asked, last = turns(row["conversations"])
        system = [{"role": "system", "content": row["system"]}] if "system" in row else []
        assert record["messages"] == system + asked  # every turn before the old answer
        assert record["previous"]["content"] == last["content"]
    assert staged["identity_0"]["messages"][0]["content"].startswith(
        "A chat between a curious user and an artificial intelligence assistant whose name is "
        "Vicuna."
    )
    assert "read as ShareGPT" in result.read_as[0]


def test_fastchat_dummy_conversation_keeps_every_turn(tmp_path: Path) -> None:
    name = "dummy_conversation.sample.json"
    rows = published(name)
    staged, result = stage(tmp_path, name, regenerate=True)
    assert len(staged) == len(rows) == 20 and result.rejects == 0
    record = staged["identity_0"]
    assert record["messages"] == [
        user("Who are you?"),
        {
            "role": "assistant",
            "content": "I am Vicuna, a language model trained by researchers from Large Model "
            "Systems Organization (LMSYS).",
        },
        user("Have a nice day!"),
    ]
    assert record["previous"]["content"] == "You too!"


def test_fastchat_conversations_without_regenerate_are_refused_naming_the_flag(
    tmp_path: Path,
) -> None:
    with pytest.raises(InputError, match="--regenerate"):
        stage(tmp_path, "dummy_conversation.sample.json")


def test_mt_bench_questions_are_refused_naming_first_turn(tmp_path: Path) -> None:
    with pytest.raises(InputError) as raised:
        stage(tmp_path, "mt_bench_question.sample.jsonl")
    said = str(raised.value)
    assert "mt_bench_question.sample.jsonl:1 [turns]" in said and "MT-bench" in said
    assert "--first-turn" in said


def test_mt_bench_first_turn_is_each_questions_prompt(tmp_path: Path) -> None:
    staged, result = stage(tmp_path, "mt_bench_question.sample.jsonl", first_turn=True)
    rows = published("mt_bench_question.sample.jsonl")
    assert len(staged) == len(rows) and result.rejects == 0
    for number, row in enumerate(rows, start=1):
        record = staged[f"mt_bench_question.sample.jsonl:{number}"]
        assert record["messages"] == [user(row["turns"][0])]
        assert record.get("previous") is None
    [said] = result.read_as
    assert "read as MT-bench" in said and "--first-turn" in said and "old answer none" in said


def test_mt_bench_first_turn_with_regenerate_is_refused(tmp_path: Path) -> None:
    with pytest.raises(InputError, match="no old answer|none of its prompts has an old answer"):
        stage(tmp_path, "mt_bench_question.sample.jsonl", first_turn=True, regenerate=True)
