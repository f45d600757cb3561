"""`--regenerate` where there is no old answer to replace: a source none of whose prompts has
one (plain prompts, a chat ending with the user's turn) is refused before
anything is written, naming how it was read and what would read an old answer; a source where
some have one stages, and says how many prompts are asked afresh."""

from __future__ import annotations

import os
import threading
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
from tests.fakes.memory_store import MemoryStore
from tests.support.commands import invoke

RUN = "regen"


def write(path: Path, rows: list[dict[str, Any]]) -> str:
    path.write_bytes(b"".join(orjson.dumps(row) + b"\n" for row in rows))
    return str(path)


def stage(
    source: str, store: MemoryStore, sent: list[tuple[WorkOrder, int]] | None = None
) -> enqueue.EnqueueResult:
    """Stage `source` under --regenerate; each order sent is kept in `sent` with the number of
    batches staged when it was sent."""
    settings = Settings(regenerate=True, store="file:///unused", batch_size=1)
    sent = sent if sent is not None else []

    def send(orders: list[WorkOrder]) -> int:
        staged = sum("/inputs/" in key for key in store.objects)
        sent.extend((order, staged) for order in orders)
        return len(orders)

    reader = ReaderOptions(regenerate=True)
    _, result = enqueue.stage(settings, store, RUN, source, reader, send, set())
    return result


@pytest.mark.parametrize(
    ("rows", "shape"),
    [
        ([{"prompt": "What is 17 * 23?"}, {"prompt": "Name a prime."}], "prompt"),
        (
            [{"messages": [{"role": "user", "content": "hi"}]}] * 2,
            "chat",
        ),
        (
            [{"conversations": [{"from": "human", "value": "hi"}], "id": str(i)} for i in range(2)],
            "ShareGPT",
        ),
    ],
)
def test_a_source_with_no_old_answer_is_refused_and_nothing_recorded(
    tmp_path: Path, rows: list[dict[str, Any]], shape: str
) -> None:
    source = write(tmp_path / "d.jsonl", rows)
    store = MemoryStore()
    with pytest.raises(InputError) as refused:
        stage(source, store)
    said = str(refused.value)
    assert "--regenerate" in said and f"read as {shape}" in said and "--answer-col" in said
    assert store.objects == {}  # no claim, no batch, no manifest
    assert store.get(keys.manifest_key(RUN)) is None


def test_a_source_where_some_prompts_have_an_old_answer_stages_and_counts_the_rest(
    tmp_path: Path,
) -> None:
    answered = [{"role": "user", "content": "q"}, {"role": "assistant", "content": "old"}]
    rows = [
        {"messages": answered},
        {"messages": [{"role": "user", "content": "new"}]},
        {"messages": [{"role": "user", "content": "new too"}]},
    ]
    store = MemoryStore()
    result = stage(write(tmp_path / "d.jsonl", rows), store)
    assert (result.prompts, result.without_previous, result.rejects) == (3, 2, 0)
    manifest = orjson.loads(store.objects[keys.manifest_key(RUN)])
    assert manifest["staging"]["regenerate"] is True


def test_enqueue_says_how_many_prompts_are_asked_afresh_and_refuses_a_source_with_none(
    tmp_path: Path, redis_url: str
) -> None:
    answered = [{"role": "user", "content": "q"}, {"role": "assistant", "content": "old"}]
    mixed = write(tmp_path / "m.jsonl", [{"messages": answered}, {"prompt": "new"}])
    plain = write(tmp_path / "p.jsonl", [{"prompt": "new"}])
    env = {"GENFLEET_REDIS_URL": redis_url, "GENFLEET_STORE": (tmp_path / "store").as_uri()}
    said = invoke("enqueue", mixed, "--run", "m", "--regenerate", env=env)
    assert said.exit_code == 0, said.output
    assert "no old answer in 1 of 2 prompts" in " ".join(said.output.split())
    as_json = invoke("enqueue", mixed, "--run", "m2", "--regenerate", "--json", env=env)
    assert orjson.loads(as_json.stdout)["without_previous"] == 1
    refused = invoke("enqueue", plain, "--run", "p", "--regenerate", env=env)
    assert refused.exit_code == 2 and "none of its prompts has an old answer" in refused.output
    assert not (tmp_path / "store/p").exists()  # the run is not recorded


def piped(path: Path, rows: list[dict[str, Any]]) -> str:
    """A named pipe that gives `rows` once, as `cat data | genfleet enqueue /dev/stdin` would."""
    os.mkfifo(path)

    def feed() -> None:
        with path.open("wb") as pipe:
            pipe.write(b"".join(orjson.dumps(row) + b"\n" for row in rows))

    threading.Thread(target=feed, daemon=True).start()
    return str(path)


def test_a_stream_with_no_old_answer_is_refused_with_nothing_sent_or_kept(tmp_path: Path) -> None:
    store, sent = MemoryStore(), []
    rows: list[dict[str, Any]] = [{"prompt": f"question {i}"} for i in range(5)]
    with pytest.raises(InputError, match="none of its prompts has an old answer"):
        stage(piped(tmp_path / "pipe.jsonl", rows), store, sent)
    assert sent == [] and store.objects == {}


def test_a_stream_sends_its_orders_once_an_old_answer_is_staged(tmp_path: Path) -> None:
    store, sent = MemoryStore(), []
    answered = [{"role": "user", "content": "q"}, {"role": "assistant", "content": "old"}]
    rows = [*({"prompt": f"question {i}"} for i in range(3)), {"messages": answered}]
    result = stage(piped(tmp_path / "pipe.jsonl", rows), store, sent)
    assert (result.prompts, result.without_previous) == (4, 3)
    assert len(sent) == result.batches_enqueued == 4  # one prompt a batch, none lost
    # held until the answered prompt (the fourth batch) was staged
    assert min(staged for _, staged in sent) == 4
