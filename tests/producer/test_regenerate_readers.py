"""The shapes training sets come in (ShareGPT, other field names, zstd), and the old answers
in them: refused by default, kept as `previous` with --regenerate, never left in the messages."""

from __future__ import annotations

import gzip
import os
from pathlib import Path
from typing import Any

import orjson
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import zstandard

from genfleet.common.readers import ReaderOptions, detect_format, read_source
from genfleet.common.readers.fields import REGENERATE_HINT, split_think
from harness.sources import lines, save_dataset, split
from tests.support.s3 import Bucket


def sharegpt(*turns: tuple[str, str]) -> dict[str, Any]:
    return {"conversations": [{"from": who, "value": text} for who, text in turns]}


@pytest.mark.parametrize(
    ("speaker", "role"),
    [
        ("human", "user"),
        ("user", "user"),
        ("gpt", "assistant"),
        ("assistant", "assistant"),
        ("model", "assistant"),
        ("system", "system"),
    ],
)
def test_sharegpt_speakers_become_roles(tmp_path: Path, speaker: str, role: str) -> None:
    line = sharegpt(("system", "be kind"), (speaker, "turn"), ("human", "last question"))
    records, rejects = split(read_source(lines(tmp_path / "s.jsonl", [line])))
    assert rejects == []
    assert records[0].messages == [
        {"role": "system", "content": "be kind"},
        {"role": role, "content": "turn"},
        {"role": "user", "content": "last question"},
    ]


def test_a_turn_without_text_rejects_the_line_naming_its_value(tmp_path: Path) -> None:
    bad = {"conversations": [{"from": "human", "value": None}]}
    path = lines(tmp_path / "s.jsonl", [bad, sharegpt(("human", "  "))])
    records, rejects = split(read_source(path))
    assert records == []
    assert [(r.line, r.field) for r in rejects] == [
        (1, "conversations[0].value"),
        (2, "conversations[0].value"),
    ]


@pytest.mark.parametrize("speaker", ["bing", "Human", "tool", None])
def test_an_unknown_speaker_rejects_the_line_naming_turn_and_value(
    tmp_path: Path, speaker: str | None
) -> None:
    bad = {"conversations": [{"from": "human", "value": "q"}, {"from": speaker, "value": "a"}]}
    path = lines(tmp_path / "s.jsonl", [sharegpt(("human", "fine")), bad])
    records, rejects = split(read_source(path))
    assert [r.id for r in records] == ["s.jsonl:1"]
    [reject] = rejects
    assert (reject.file, reject.line, reject.field) == (str(path), 2, "conversations[1].from")
    assert repr(speaker) in reject.reason


@pytest.mark.parametrize(
    ("line", "field"),
    [
        ({"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]},
         "messages[-1]"),
        (sharegpt(("human", "q"), ("gpt", "a")), "conversations[-1]"),
        ({"custom_id": "c1", "body": {"messages": [
            {"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]}},
         "body.messages[-1]"),
    ],
)  # fmt: skip
def test_a_conversation_ending_with_an_answer_is_refused_without_regenerate(
    tmp_path: Path, line: dict[str, Any], field: str
) -> None:
    path = lines(tmp_path / "d.jsonl", [{"prompt": "ok"}, line])
    records, rejects = split(read_source(path))
    assert [r.id for r in records] == ["d.jsonl:1"]
    [reject] = rejects
    assert (reject.file, reject.line, reject.field, reject.reason) == (
        str(path),
        2,
        field,
        REGENERATE_HINT,
    )
    assert str(reject).endswith(f"[{field}]: ends with an assistant answer: pass --regenerate to "
                                "replace it")  # fmt: skip


def test_regenerate_removes_the_answer_and_keeps_it_as_previous(tmp_path: Path) -> None:
    rows = [
        sharegpt(("human", "2+2?"), ("gpt", "<think>add them</think>\n\n4")),
        {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "OK."}]},
        {"messages": [{"role": "user", "content": "q"}]},  # nothing to replace: passes as is
        {"messages": [
            {"role": "user", "content": "q"},
            {"role": "assistant", "content": "a", "reasoning_content": "why"},
        ]},
        {"messages": [{"role": "user", "content": "q"},
                      {"role": "assistant", "content": [{"type": "text", "text": "parts"}]}]},
    ]  # fmt: skip
    records, rejects = split(
        read_source(lines(tmp_path / "d.jsonl", rows), ReaderOptions(regenerate=True))
    )
    assert rejects == []
    assert [r.messages for r in records] == [
        [{"role": "user", "content": "2+2?"}],
        [{"role": "user", "content": "hi"}],
        [{"role": "user", "content": "q"}],
        [{"role": "user", "content": "q"}],
        [{"role": "user", "content": "q"}],
    ]
    assert [r.previous for r in records] == [
        {"content": "4", "reasoning": "add them"},
        {"content": "OK.", "reasoning": None},
        None,
        {"content": "a", "reasoning": "why"},
        {"content": "parts", "reasoning": None},
    ]
    assert all(m["role"] != "assistant" for r in records for m in r.messages)


@pytest.mark.parametrize(
    ("messages", "field", "reason"),
    [
        ([{"role": "user", "content": "q"}, {"role": "assistant", "content": "a1"},
          {"role": "assistant", "content": "a2"}], "messages[-2]", "assistant turn too"),
        ([{"role": "system", "content": "s"}, {"role": "assistant", "content": "a"}],
         "messages[-1]", "nothing is left"),
        ([{"role": "assistant", "content": "a"}], "messages[-1]", "nothing is left"),
        ([{"role": "user", "content": "q"},
          {"role": "assistant", "content": None, "tool_calls": [{"id": "t"}]}],
         "messages[-1].content", "not text"),
    ],
)  # fmt: skip
def test_regenerate_refuses_what_would_still_end_with_an_answer(
    tmp_path: Path, messages: list[dict[str, Any]], field: str, reason: str
) -> None:
    path = lines(tmp_path / "d.jsonl", [{"messages": messages}])
    records, rejects = split(read_source(path, ReaderOptions(regenerate=True)))
    assert records == []
    assert (rejects[0].file, rejects[0].line, rejects[0].field) == (str(path), 1, field)
    assert reason in rejects[0].reason


@pytest.mark.parametrize(
    ("text", "reasoning", "content"),
    [
        ("plain", None, "plain"),
        ("<think>r</think>c", "r", "c"),
        ("  <think>\nr\n</think>\n\nc", "r", "c"),
        ("r only closed</think>c", "r only closed", "c"),  # the opening tag was the template's
        ("<think>cut at the cap", "cut at the cap", ""),
    ],
)
def test_split_think(text: str, reasoning: str | None, content: str) -> None:
    assert split_think(text) == (reasoning, content)


def test_column_options_name_jsonl_fields(tmp_path: Path) -> None:
    rows = [
        {"uid": "u1", "question": "what?"},
        {"uid": "u2", "query": "other field"},
        {"question": "no uid"},
        {"uid": 3, "question": "   "},
    ]
    path = lines(tmp_path / "q.jsonl", rows)
    records, rejects = split(read_source(path, ReaderOptions(prompt_col="question", id_col="uid")))
    assert [(r.id, r.messages) for r in records] == [("u1", [{"role": "user", "content": "what?"}])]
    assert [(r.line, r.field) for r in rejects] == [(2, "question"), (3, "uid"), (4, "question")]
    assert "--prompt-col" in rejects[0].reason and "--id-col" in rejects[1].reason


def test_messages_col_reads_chat_or_sharegpt_turns_from_any_field(tmp_path: Path) -> None:
    rows = [
        {"dialog": [{"from": "human", "value": "a"}]},
        {"dialog": [{"role": "user", "content": "b"}]},
        {"messages": [{"role": "user", "content": "not this field"}]},
    ]
    path = lines(tmp_path / "d.jsonl", rows)
    records, rejects = split(read_source(path, ReaderOptions(messages_col="dialog")))
    assert [r.messages[0]["content"] for r in records] == ["a", "b"]
    assert [(r.line, r.field) for r in rejects] == [(3, "dialog")]
    assert "--messages-col" in rejects[0].reason


def zst(rows: list[dict[str, Any]]) -> bytes:
    data = b"".join(orjson.dumps(row) + b"\n" for row in rows)
    half = len(data) // 2  # two frames, as zstd's CLI writes for concatenated input
    compressor = zstandard.ZstdCompressor()
    return compressor.compress(data[:half]) + compressor.compress(data[half:])


def test_jsonl_zst_files_and_folders_of_mixed_compression(tmp_path: Path) -> None:
    rows = [{"prompt": f"p{i}"} for i in range(40)]
    (tmp_path / "a.jsonl.zst").write_bytes(zst(rows))
    assert detect_format(tmp_path / "a.jsonl.zst") == "jsonl"
    records, rejects = split(read_source(tmp_path / "a.jsonl.zst"))
    assert rejects == [] and [r.messages[0]["content"] for r in records] == [
        r["prompt"] for r in rows
    ]

    folder = tmp_path / "shards"
    folder.mkdir()
    (folder / "0.jsonl").write_bytes(orjson.dumps({"prompt": "plain"}) + b"\n")
    (folder / "1.jsonl.gz").write_bytes(gzip.compress(orjson.dumps({"prompt": "gz"}) + b"\n"))
    (folder / "2.jsonl.zst").write_bytes(zst([sharegpt(("human", "zst"))]))
    assert detect_format(folder) == "jsonl"
    records, _ = split(read_source(folder))
    assert [(r.id, r.messages[0]["content"]) for r in records] == [
        ("0.jsonl:1", "plain"),
        ("1.jsonl.gz:1", "gz"),
        ("2.jsonl.zst:1", "zst"),
    ]


@pytest.mark.parametrize("suffix", [".jsonl.zst", ".jsonl.gz"])
def test_corrupt_compressed_data_is_a_reject_not_a_silent_end(tmp_path: Path, suffix: str) -> None:
    noise = [os.urandom(150).hex() for _ in range(2000)]  # several compressed blocks
    data = b"".join(orjson.dumps({"prompt": text}) + b"\n" for text in noise)
    packed = (
        zstandard.ZstdCompressor().compress(data) if suffix == ".jsonl.zst" else gzip.compress(data)
    )
    path = tmp_path / f"bad{suffix}"
    path.write_bytes(packed[: len(packed) // 2] + b"\x00garbage" * 8)
    records, rejects = split(read_source(path))
    assert 0 < len(records) < 2000
    # The lines the data broke in may come out as junk before the decoder notices: "not JSON".
    *partial, reject = rejects
    assert all(r.reason.startswith("not ") for r in partial)
    assert (reject.file, reject.line) == (str(path), len(records) + len(rejects))
    assert "corrupt" in reject.reason


def test_parquet_sharegpt_column_and_regenerate(tmp_path: Path) -> None:
    turns = [
        [{"from": "human", "value": "q1"}, {"from": "gpt", "value": "old1"}],
        [{"from": "human", "value": "q2"}],
        [{"from": "human", "value": "q3"}, {"from": "gpt", "value": "<think>t</think>old3"}],
    ]
    pq.write_table(pa.table({"conversations": turns}), tmp_path / "s.parquet")
    records, rejects = split(read_source(tmp_path / "s.parquet"))
    assert [r.id for r in records] == ["s.parquet:1"]
    assert [(r.line, r.field, r.reason) for r in rejects] == [
        (0, "conversations[-1]", f"row 0: {REGENERATE_HINT}"),
        (2, "conversations[-1]", f"row 2: {REGENERATE_HINT}"),
    ]
    records, rejects = split(read_source(tmp_path / "s.parquet", ReaderOptions(regenerate=True)))
    assert rejects == []
    assert [r.messages for r in records] == [
        [{"role": "user", "content": q}] for q in ("q1", "q2", "q3")
    ]
    assert [r.previous for r in records] == [
        {"content": "old1", "reasoning": None},
        None,
        {"content": "old3", "reasoning": "t"},
    ]


def test_hf_saved_dataset_of_sharegpt_rows_with_regenerate(tmp_path: Path) -> None:
    table = pa.table(
        {"conversations": [[{"from": "human", "value": "q"}, {"from": "gpt", "value": "a"}]]}
    )
    path = save_dataset(tmp_path / "saved", [table])
    records, rejects = split(read_source(path, ReaderOptions(regenerate=True)))
    assert rejects == []
    assert records[0].messages == [{"role": "user", "content": "q"}]
    assert records[0].previous == {"content": "a", "reasoning": None}


def test_samples_of_a_regenerated_prompt_all_keep_the_old_answer(tmp_path: Path) -> None:
    path = lines(tmp_path / "d.jsonl", [sharegpt(("human", "q"), ("gpt", "old"))])
    records, _ = split(read_source(path, ReaderOptions(regenerate=True, samples=3)))
    assert [r.sample for r in records] == [0, 1, 2]
    assert all(r.previous == {"content": "old", "reasoning": None} for r in records)


@pytest.mark.integration
def test_jsonl_zst_from_s3_a_file_and_a_folder(s3_server: str) -> None:
    bucket = Bucket(s3_server)
    rows = [sharegpt(("human", f"q{i}"), ("gpt", f"old {i}")) for i in range(30)]
    url = bucket.put("sets/chat.jsonl.zst", zst(rows))
    bucket.put("folder/a.jsonl.zst", zst(rows[:10]))
    bucket.put("folder/b.jsonl", b"".join(orjson.dumps(r) + b"\n" for r in rows[10:]))
    folder = url.replace("sets/chat.jsonl.zst", "folder/")
    cases = ((url, ["chat.jsonl.zst"] * 30), (folder, ["a.jsonl.zst"] * 10 + ["b.jsonl"] * 20))
    for source, names in cases:
        records, rejects = split(read_source(source, bucket.options(regenerate=True)))
        assert rejects == []
        assert [r.id.split(":")[0] for r in records] == names
        assert [r.previous for r in records] == [
            {"content": f"old {i}", "reasoning": None} for i in range(30)
        ]
