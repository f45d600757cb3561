"""One shape per file, said aloud, and the columns a flag names (`--system-col`,
`--answer-col`) obeyed over anything else on the row."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from genfleet.common.readers import ReadAs, ReaderOptions, read_source
from genfleet.common.readers import jsonl as jsonl_reader
from genfleet.common.readers.shapes import file_shape, fits
from harness.sources import lines, split

ALPACA = {"instruction": "Name a color.", "input": "", "output": "Red."}
DOLLY = {"instruction": "Summarize.", "context": "A text.", "response": "Short."}
CHAT = {"messages": [{"role": "user", "content": "hi"}]}
PROMPT = {"prompt": "tell me"}


@pytest.mark.parametrize(
    ("shapes", "read_as"),
    [
        ([], None),
        (["Alpaca"], "Alpaca"),
        (["chat", "prompt"], "chat + prompt"),  # each line names its own reading
        (["chat", "OpenAI Batch"], "chat + OpenAI Batch"),
        (["Alpaca", "Dolly"], None),  # two guesses from field names
        (["chat", "Alpaca"], None),
        (["OpenOrca", "prompt"], None),
    ],
)
def test_the_shape_a_file_is_read_as(shapes: list[str], read_as: str | None) -> None:
    assert file_shape(shapes) == read_as


@pytest.mark.parametrize(
    ("row", "file", "fit"),
    [
        ("Alpaca", "Alpaca", True),
        ("Dolly", "Alpaca", False),
        ("prompt", "chat", True),
        ("prompt", "chat + prompt", True),
        ("Alpaca", "chat + prompt", False),
        ("chat", "Dolly", False),
    ],
)
def test_a_row_fits_its_file(row: str, file: str, fit: bool) -> None:
    assert fits(row, file) is fit


def test_a_file_mixing_shapes_is_refused_naming_the_lines_and_other_files_are_read(
    tmp_path: Path,
) -> None:
    folder = tmp_path / "set"
    folder.mkdir()
    mixed = lines(folder / "a.jsonl", [ALPACA, DOLLY, ALPACA, ALPACA, DOLLY])
    lines(folder / "b.jsonl", [ALPACA, ALPACA])
    said: list[ReadAs] = []
    records, rejects = split(read_source(folder, ReaderOptions(regenerate=True), said))
    assert [r.id for r in records] == ["b.jsonl:1", "b.jsonl:2"]
    [reject] = rejects
    assert (reject.file, reject.line, reject.truncated) == (str(mixed), None, True)
    assert "Alpaca (lines 1, 3, 4)" in reject.reason and "Dolly (lines 2, 5)" in reject.reason
    assert "--prompt-col" in reject.reason
    assert [(r.file, r.shape) for r in said] == [(str(folder / "b.jsonl"), "Alpaca")]


def test_a_json_array_mixing_shapes_is_refused_naming_its_elements(tmp_path: Path) -> None:
    import orjson

    path = tmp_path / "set.json"
    path.write_bytes(orjson.dumps([DOLLY, CHAT, DOLLY]))
    records, rejects = split(read_source(path, ReaderOptions(regenerate=True)))
    assert records == []
    [reject] = rejects
    assert "Dolly (elements 1, 3)" in reject.reason and "chat (elements 2)" in reject.reason
    assert reject.truncated and reject.rows_unread == 3


def test_past_the_first_rows_a_row_of_another_shape_is_its_lines_reject(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(jsonl_reader, "PREFIX_ROWS", 2)
    path = lines(tmp_path / "a.jsonl", [ALPACA, ALPACA, DOLLY, ALPACA, PROMPT])
    records, rejects = split(read_source(path, ReaderOptions(regenerate=True)))
    assert [r.id for r in records] == ["a.jsonl:1", "a.jsonl:2", "a.jsonl:4"]
    assert [(r.line, r.field) for r in rejects] == [(3, None), (5, None)]
    assert "a Dolly row in a file read as Alpaca" in rejects[0].reason


def test_chat_and_prompt_lines_share_a_file_and_say_so(tmp_path: Path) -> None:
    path = lines(tmp_path / "a.jsonl", [CHAT, PROMPT, CHAT])
    said: list[ReadAs] = []
    records, rejects = split(read_source(path, ReaderOptions(), said))
    assert rejects == [] and len(records) == 3
    [reading] = said
    assert reading.shape == "chat + prompt"
    assert reading.prompt == "`messages` or `prompt`"


def test_each_file_says_what_it_was_read_as(tmp_path: Path) -> None:
    orca = {"id": "o1", "system_prompt": "Be brief.", "question": "Why?", "response": "So."}
    lines(tmp_path / "orca.jsonl", [orca])
    pq.write_table(pa.Table.from_pylist([DOLLY]), tmp_path / "dolly.parquet")
    said: list[ReadAs] = []
    options = ReaderOptions(regenerate=True)
    split(read_source(tmp_path / "orca.jsonl", options, said))
    split(read_source(tmp_path / "dolly.parquet", options, said))
    split(read_source(tmp_path / "orca.jsonl", ReaderOptions(id_col="id"), said))
    kept = "`response` (kept with --regenerate)"
    assert [(r.shape, r.prompt, r.answer) for r in said] == [
        ("OpenOrca", "`question`", kept),
        ("Dolly", "`instruction`, then `context` when not empty", kept),
        ("OpenOrca", "`question`", "`response` (needs --regenerate)"),
    ]
    assert said[2].id == "`id` (--id-col)"


# --- --system-col and --answer-col ---------------------------------------------------------
def user(text: str) -> dict[str, str]:
    return {"role": "user", "content": text}


NAMED = ReaderOptions(prompt_col="q", system_col="sys", answer_col="a", regenerate=True)


def named_rows() -> list[dict[str, Any]]:
    return [
        # `system` and `system_prompt` are not the system prompt: --system-col names it
        {"q": "Why?", "sys": "Be brief.", "system": "ignored", "a": "Because.", "output": "no"},
        {"q": "How?", "sys": "", "a": "So."},  # an empty system prompt adds no turn
        {"q": "When?", "sys": None, "a": "Now."},
        {"q": "Where?", "sys": "Be brief.", "a": None},
        {"q": "Who?", "a": "Me."},
    ]


def check_named(records: list[Any], rejects: list[Any], first: int) -> None:
    assert [r.messages for r in records] == [
        [{"role": "system", "content": "Be brief."}, user("Why?")],
        [user("How?")],
    ]
    assert [r.previous["content"] for r in records] == ["Because.", "So."]
    assert [(r.line, r.field) for r in rejects] == [(first + 2, "sys"), (first + 3, "a"),
                                                    (first + 4, "sys")]  # fmt: skip
    assert "--system-col" in rejects[0].reason and "--answer-col" in rejects[1].reason
    assert "is null" in rejects[0].reason and "is missing" in rejects[2].reason


def test_named_system_and_answer_columns_are_obeyed_in_jsonl(tmp_path: Path) -> None:
    path = lines(tmp_path / "a.jsonl", named_rows())
    check_named(*split(read_source(path, NAMED)), first=1)


def test_named_system_and_answer_columns_are_obeyed_in_parquet(tmp_path: Path) -> None:
    rows = named_rows()
    for row in rows:
        row.pop("system", None), row.pop("output", None)
    rows[4]["sys"] = None  # a Parquet column has every row: the missing value is a null
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "a.parquet")
    records, rejects = split(read_source(tmp_path / "a.parquet", NAMED))
    assert [r.previous["content"] for r in records if r.previous] == ["Because.", "So."]
    assert [(r.line, r.field) for r in rejects] == [(2, "sys"), (3, "a"), (4, "sys")]
    pq.write_table(pa.table({"q": ["x"]}), tmp_path / "b.parquet")
    records, rejects = split(read_source(tmp_path / "b.parquet", NAMED))
    assert records == [] and rejects[0].field == "sys" and "--system-col" in rejects[0].reason


def test_a_named_answer_column_replaces_a_shapes_own_and_needs_regenerate(
    tmp_path: Path,
) -> None:
    row = {**ALPACA, "better": "Blue."}
    path = lines(tmp_path / "a.jsonl", [row])
    records, _ = split(read_source(path, ReaderOptions(answer_col="better", regenerate=True)))
    assert records[0].messages == [user("Name a color.")]
    assert records[0].previous is not None and records[0].previous["content"] == "Blue."
    records, rejects = split(read_source(path, ReaderOptions(answer_col="better")))
    assert records == [] and rejects[0].field == "better" and "--regenerate" in rejects[0].reason


def test_a_named_answer_beside_a_conversation_that_ends_with_one_is_refused(
    tmp_path: Path,
) -> None:
    chat = {"messages": [user("q"), {"role": "assistant", "content": "a"}], "old": "b"}
    path = lines(tmp_path / "a.jsonl", [chat])
    options = ReaderOptions(messages_col="messages", answer_col="old", regenerate=True)
    records, rejects = split(read_source(path, options))
    assert records == [] and rejects[0].field == "old"


@pytest.mark.integration
def test_enqueue_says_what_each_file_was_read_as(tmp_path: Path, redis_url: str) -> None:
    import os

    import orjson

    from tests.support.commands import genfleet

    source = lines(tmp_path / "dolly.jsonl", [DOLLY, DOLLY])
    env = {**os.environ, "GENFLEET_REDIS_URL": redis_url, "COLUMNS": "200", "TERM": "xterm"}
    store = (tmp_path / "store").as_uri()
    argv = ["enqueue", str(source), "--store", store, "--regenerate", "--system-col", "context"]
    done = genfleet([*argv, "--run", "shapes"], env, timeout_s=60)
    assert done.returncode == 0, done.stderr
    said = " ".join(done.stderr.split())
    assert f"{source}: read as Dolly: prompt `instruction`, then `context`" in said, said
    assert "system `context` (--system-col)" in said
    done = genfleet([*argv, "--run", "shapes2", "--json"], env, timeout_s=60)
    assert done.returncode == 0, done.stderr
    [reading] = orjson.loads(done.stdout)["read_as"]
    assert reading.startswith(f"{source}: read as Dolly")
