"""Published training sets as they are (tests/data, sources in its README), end to end: each
sample enqueued as its own run to one real worker and its emulator, whose request log says
what the engine received. For every record the engine got exactly the set's system turn, the
whole prompt (Alpaca's input, Dolly's context) and the turns before the old answer, and never
an old answer; `genfleet export` holds every old answer as `previous`. The samples cover every
shape README's table names: Alpaca, Dolly, OpenOrca, query/response (MetaMathQA), MT-bench
(`--first-turn`), ShareGPT with and without a system, OpenAI fine-tuning chats, an OpenAI Batch
file (whose lines' own parameters reach the engine) and a plain `prompt` set (IFEval)."""

from __future__ import annotations

import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import orjson
import pytest
import redis

from genfleet.common import keys
from genfleet.common.store import open_store
from genfleet.producer.status import run_status
from harness.env import TEST_REDIS_URL, base_env
from harness.processes import Worker
from harness.resends import sent_lines
from harness.waits import wait_for
from tests.support.commands import invoke

pytestmark = [pytest.mark.integration, pytest.mark.slow]

DATA = Path(__file__).resolve().parents[1] / "data"
Message = dict[str, str]
# A record as the set implies it: its id, what the engine must receive, its old answer.
Expected = tuple[str, list[Message], str | None]


def user(text: str) -> Message:
    return {"role": "user", "content": text}


def rows_of(name: str) -> list[dict[str, Any]]:
    raw = (DATA / name).read_bytes()
    if name.endswith(".json"):
        rows: list[dict[str, Any]] = orjson.loads(raw)
        return rows
    return [orjson.loads(line) for line in raw.splitlines() if line.strip()]


def joined(first: str, second: str) -> str:
    return f"{first}\n\n{second}" if second.strip() else first


def alpaca(name: str) -> list[Expected]:
    return [
        (f"{name}:{n}", [user(joined(r["instruction"], r["input"]))], r["output"])
        for n, r in enumerate(rows_of(name), start=1)
    ]


def dolly(name: str) -> list[Expected]:
    return [
        (f"{name}:{n}", [user(joined(r["instruction"], r["context"]))], r["response"])
        for n, r in enumerate(rows_of(name), start=1)
    ]


def openorca(name: str) -> list[Expected]:
    def system(r: dict[str, Any]) -> list[Message]:
        text = r["system_prompt"]
        return [{"role": "system", "content": text}] if text.strip() else []

    return [(r["id"], [*system(r), user(r["question"])], r["response"]) for r in rows_of(name)]


def mt_bench(name: str) -> list[Expected]:
    return [(f"{name}:{n}", [user(r["turns"][0])], None) for n, r in enumerate(rows_of(name), 1)]


def sharegpt(name: str) -> list[Expected]:
    roles = {"human": "user", "gpt": "assistant"}
    expected = []
    for r in rows_of(name):
        turns = [{"role": roles[t["from"]], "content": t["value"]} for t in r["conversations"]]
        system = [{"role": "system", "content": r["system"]}] if r.get("system") else []
        expected.append((r["id"], system + turns[:-1], turns[-1]["content"]))
    return expected


# sample → {line: field} of the lines a set publishes that cannot be asked, each a reject:
# the OpenAI Cookbook's toy file has, on purpose, a conversation of a system turn and an
# answer, which leaves nothing to answer once the old answer is removed.
REJECTED: dict[str, dict[int, str]] = {"toy_chat_fine_tuning.jsonl": {4: "messages[-1]"}}


def chat(name: str) -> list[Expected]:
    expected = []
    for n, r in enumerate(rows_of(name), start=1):
        if n in REJECTED.get(name, {}):
            continue
        *asked, old = r["messages"]
        expected.append((f"{name}:{n}", asked, old["content"]))
    return expected


def openai_batch(name: str) -> list[Expected]:
    return [(r["custom_id"], r["body"]["messages"], None) for r in rows_of(name)]


def prompt(name: str) -> list[Expected]:
    return [(f"{name}:{n}", [user(r["prompt"])], None) for n, r in enumerate(rows_of(name), 1)]


def query_response(name: str) -> list[Expected]:
    return [
        (f"{name}:{n}", [user(r["query"])], r["response"])
        for n, r in enumerate(rows_of(name), start=1)
    ]


# sample → (what it implies, its enqueue flags)
SAMPLES: dict[str, tuple[Callable[[str], list[Expected]], list[str]]] = {
    "alpaca_data.sample.json": (alpaca, ["--regenerate"]),
    "dolly.sample.jsonl": (dolly, ["--regenerate"]),
    "openorca.sample.jsonl": (openorca, ["--regenerate"]),
    "mt_bench_question.sample.jsonl": (mt_bench, ["--first-turn"]),  # no old answer
    "dummy_conversation.sample.json": (sharegpt, ["--regenerate"]),
    "dummy_conversation_with_system.sample.json": (sharegpt, ["--regenerate"]),
    "toy_chat_fine_tuning.jsonl": (chat, ["--regenerate"]),
    "openai_example_batch.sample.jsonl": (openai_batch, []),  # no old answer
    "ifeval_input_data.sample.jsonl": (prompt, []),  # no old answer
    "metamathqa.sample.jsonl": (query_response, ["--regenerate"]),
}


@dataclass
class Fleet:
    """What one worker made of every sample: the engine's requests, and each run's export."""

    requests: list[list[Message]]
    bodies: list[dict[str, Any]]  # the engine's request bodies, in the order of `requests`
    exports: dict[str, dict[str, dict[str, Any]]]  # sample → id → exported row
    reports: dict[str, dict[str, Any]]  # sample → `report --json`
    rejects: dict[str, dict[int, str | None]]  # sample → {line: field} of its rejects


def run_name(sample: str) -> str:
    return sample.split(".")[0]


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    """Every sample enqueued as its own run, generated by one worker, exported."""
    tmp = tmp_path_factory.mktemp("published")
    client = redis.Redis.from_url(TEST_REDIS_URL)
    try:
        client.ping()
    except redis.RedisError as exc:
        pytest.skip(f"no Redis at {TEST_REDIS_URL}: {exc}")
    client.flushdb()
    store_url = (tmp / "store").as_uri()
    request_log = tmp / "requests.jsonl"
    env = base_env(TEST_REDIS_URL, store_url, emulator_request_log=request_log, log_dir=tmp)
    worker = Worker(env, tmp / "worker.log", f"published-{uuid.uuid4().hex[:6]}@test", ["worker"])
    try:
        flags = ["--redis-url", TEST_REDIS_URL, "--store", store_url]
        for sample, (_, own) in SAMPLES.items():
            args = ["enqueue", str(DATA / sample), "--run", run_name(sample), *flags, *own]
            result = invoke(*args)
            assert result.exit_code == 0, result.output
        worker.wait_ready()
        store = open_store(store_url)

        def all_done() -> bool:
            return all(run_status(store, client, run_name(s))["state"] == "done" for s in SAMPLES)

        wait_for(all_done, 60, "every sample's run", 0.3)
        exports, reports, rejects = {}, {}, {}
        for sample in SAMPLES:
            rows = (store.get(keys.rejects_key(run_name(sample))) or b"").splitlines()
            rejects[sample] = {r["line"]: r["field"] for r in map(orjson.loads, rows)}
            result = invoke("report", run_name(sample), "--json", *flags)
            assert result.exit_code == 0, result.output
            reports[sample] = orjson.loads(result.stdout)
            out = tmp / f"{run_name(sample)}.jsonl"
            result = invoke("export", run_name(sample), "--out", str(out), *flags)
            assert result.exit_code == 0, result.output
            rows = [orjson.loads(line) for line in out.read_bytes().splitlines()]
            exports[sample] = {row["id"]: row for row in rows}
        bodies = [line["body"] for line in sent_lines(request_log)]
        yield Fleet([body["messages"] for body in bodies], bodies, exports, reports, rejects)
    finally:
        worker.stop()
        client.flushdb()
        client.close()


@pytest.mark.parametrize("sample", list(SAMPLES))
def test_the_engine_gets_every_part_and_the_export_keeps_every_old_answer(
    fleet: Fleet, sample: str
) -> None:
    implied, _ = SAMPLES[sample]
    expected = implied(sample)
    received = [orjson.dumps(messages) for messages in fleet.requests]
    exported = fleet.exports[sample]
    assert sorted(exported) == sorted(record_id for record_id, _, _ in expected)
    for record_id, messages, old in expected:
        assert orjson.dumps(messages) in received, (record_id, messages)  # exactly these
        row = exported[record_id]
        assert row["error"] is None, row
        if old is None:
            assert row.get("previous") is None
        else:
            assert row["previous"] == {"content": old, "reasoning": None}
    previous = fleet.reports[sample]["previous"]
    regenerated = [m for _, m, old in expected if old is not None]
    if not regenerated:
        assert previous is None
    else:  # report: how many conversations kept older assistant turns as context
        multi_turn = sum(any(t["role"] == "assistant" for t in m) for m in regenerated)
        assert (previous["count"], previous["with_earlier_answers"]) == (
            len(regenerated),
            multi_turn,
        )
    olds = [old for _, _, old in expected if old and len(old) > 8]
    for messages in fleet.requests:  # no old answer of this set ever reached the engine
        last = messages[-1]["content"]
        assert messages[-1]["role"] == "user" and last not in olds


def test_the_engine_got_each_record_once_and_nothing_else(fleet: Fleet) -> None:
    """The requests are the records of every sample, each once (a set may repeat a
    conversation: FastChat's dummy file does, so this is a count of each)."""
    implied = [m for sample, (read, _) in SAMPLES.items() for _, m, _ in read(sample)]
    assert sorted(map(orjson.dumps, fleet.requests)) == sorted(map(orjson.dumps, implied))


def test_a_batch_line_s_own_parameters_reach_the_engine(fleet: Fleet) -> None:
    """vLLM's published batch file asks `max_completion_tokens: 1000` of a named model: the
    engine gets those lines with `max_tokens` 1000 (the run's own default is larger), and the
    model the worker serves, not the name the line gives."""
    sample = "openai_example_batch.sample.jsonl"
    lines = {orjson.dumps(r["body"]["messages"]): r["body"] for r in rows_of(sample)}
    got = [b for b in fleet.bodies if orjson.dumps(b["messages"]) in lines]
    assert len(got) == len(lines) == 2
    for body in got:
        asked = lines[orjson.dumps(body["messages"])]
        assert body["max_tokens"] == asked["max_completion_tokens"] == 1000
        assert "max_completion_tokens" not in body
        assert body["model"] != asked["model"]
    others = [b for b in fleet.bodies if orjson.dumps(b["messages"]) not in lines]
    assert others and all(b["max_tokens"] != 1000 for b in others)


@pytest.mark.parametrize("sample", list(SAMPLES))
def test_only_the_lines_that_cannot_be_asked_are_rejected(fleet: Fleet, sample: str) -> None:
    assert fleet.rejects[sample] == REJECTED.get(sample, {})
