"""Every input format, valid and broken, through the dispatcher users call (`read_source`)."""

from __future__ import annotations

import gzip
from pathlib import Path
from typing import Any

import orjson
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from genfleet.common.errors import InputError
from genfleet.common.readers import ReaderOptions, detect_format, read_source
from harness.sources import corrupt_parquet, lines, save_dataset, split


def user(text: str) -> list[dict[str, str]]:
    return [{"role": "user", "content": text}]


# --- JSONL: chat and prompt lines ------------------------------------------------------------


def test_jsonl_chat_and_prompt_lines_with_default_ids(tmp_path: Path) -> None:
    path = lines(
        tmp_path / "data.jsonl",
        [{"id": "a", "messages": user("hi")}, {"prompt": "tell me"}, {"id": 7, "prompt": "x"}],
    )
    records, rejects = split(read_source(path))
    assert rejects == []
    assert [r.id for r in records] == ["a", "data.jsonl:2", "7"]
    assert records[1].messages == user("tell me")


def test_jsonl_gz_is_read(tmp_path: Path) -> None:
    path = tmp_path / "data.jsonl.gz"
    path.write_bytes(gzip.compress(orjson.dumps({"prompt": "p"}) + b"\n"))
    records, _ = split(read_source(path))
    assert [r.id for r in records] == ["data.jsonl.gz:1"]


@pytest.mark.parametrize(
    ("line", "field", "reason"),
    [
        (b"\xff\xfe not utf-8", None, "not UTF-8"),
        (b"{not json", None, "not JSON"),
        (b"[1, 2]", None, "JSON object"),
        (orjson.dumps({"id": "x"}), "messages", "neither"),
        (orjson.dumps({"messages": "hello"}), "messages", "list"),
        (orjson.dumps({"messages": []}), "messages", "empty"),
        (orjson.dumps({"messages": [{"role": "wizard", "content": "x"}]}), "role", "unknown"),
        (orjson.dumps({"messages": [{"role": "user"}]}), "content", "missing"),
        (orjson.dumps({"prompt": 42}), "prompt", "string"),
        (orjson.dumps({"prompt": "   "}), "prompt", "empty"),
        (orjson.dumps({"id": [1], "prompt": "x"}), "id", "string or integer"),
    ],
)
def test_jsonl_bad_line_is_one_reject_and_the_rest_proceeds(
    tmp_path: Path, line: bytes, field: str | None, reason: str
) -> None:
    path = lines(tmp_path / "d.jsonl", [{"prompt": "ok"}, line, {"prompt": "also ok"}])
    records, rejects = split(read_source(path))
    assert [r.id for r in records] == ["d.jsonl:1", "d.jsonl:3"]
    assert len(rejects) == 1
    reject = rejects[0]
    assert (reject.file, reject.line) == (str(path), 2)
    assert reason in reject.reason
    if field is None:
        assert reject.field is None
    else:
        assert reject.field is not None and field in reject.field


def test_jsonl_line_over_the_size_limit(tmp_path: Path) -> None:
    path = lines(tmp_path / "d.jsonl", [{"prompt": "x" * 500}, {"prompt": "short"}])
    records, rejects = split(read_source(path, ReaderOptions(max_line_bytes=100)))
    assert [r.id for r in records] == ["d.jsonl:2"]
    assert rejects[0].line == 1 and "over 100 bytes" in rejects[0].reason


def test_duplicate_ids_are_rejected_after_the_first(tmp_path: Path) -> None:
    path = lines(tmp_path / "d.jsonl", [{"id": "a", "prompt": "1"}, {"id": "a", "prompt": "2"}])
    records, rejects = split(read_source(path))
    assert [r.messages[0]["content"] for r in records] == ["1"]
    assert (rejects[0].line, rejects[0].field) == (2, "id")
    assert "duplicate" in rejects[0].reason


def test_system_prompt_samples_and_limit(tmp_path: Path) -> None:
    path = lines(tmp_path / "d.jsonl", [{"prompt": str(i)} for i in range(5)])
    options = ReaderOptions(system_prompt="be brief", samples=2, limit=2)
    records, _ = split(read_source(path, options))
    assert [(r.id, r.sample) for r in records] == [
        ("d.jsonl:1", 0),
        ("d.jsonl:1", 1),
        ("d.jsonl:2", 0),
        ("d.jsonl:2", 1),
    ]
    assert records[0].messages[0] == {"role": "system", "content": "be brief"}


# --- OpenAI Batch API request lines ----------------------------------------------------------


def openai_line(custom_id: str, **body: Any) -> dict[str, Any]:
    return {
        "custom_id": custom_id,
        "method": "POST",
        "url": "/v1/chat/completions",
        "body": {"model": "m", "messages": user(custom_id), **body},
    }


def test_openai_batch_lines_keep_custom_id_and_per_line_params(tmp_path: Path) -> None:
    path = lines(
        tmp_path / "batch.jsonl",
        [
            openai_line("req-1", max_tokens=64, temperature=0.0),
            openai_line("req-2", max_completion_tokens=128, top_p=0.5, stop=["\n"]),
            openai_line("req-3"),
        ],
    )
    records, rejects = split(read_source(path))
    assert rejects == []
    assert [(r.id, r.custom_id) for r in records] == [(c, c) for c in ("req-1", "req-2", "req-3")]
    assert records[0].params == {"max_tokens": 64, "temperature": 0.0}
    assert records[1].params == {"max_tokens": 128, "top_p": 0.5, "stop": ["\n"]}
    assert records[2].params is None


@pytest.mark.parametrize(
    ("change", "field"),
    [
        ({"method": "GET"}, "method"),
        ({"url": "/v1/embeddings"}, "url"),
        ({"body": "nope"}, "body"),
        ({"body": {"messages": []}}, "body.messages"),
        ({"body": {"messages": user("x"), "max_tokens": 0}}, "body.max_tokens"),
        ({"body": {"messages": user("x"), "temperature": "hot"}}, "body.temperature"),
    ],
)
def test_openai_batch_bad_lines(tmp_path: Path, change: dict[str, Any], field: str) -> None:
    path = lines(tmp_path / "b.jsonl", [{**openai_line("r1"), **change}, openai_line("r2")])
    records, rejects = split(read_source(path))
    assert [r.id for r in records] == ["r2"]
    assert rejects[0].field == field and rejects[0].line == 1


def test_format_openai_requires_batch_lines(tmp_path: Path) -> None:
    path = lines(tmp_path / "b.jsonl", [{"prompt": "not a batch line"}, openai_line("r")])
    records, rejects = split(read_source(path, ReaderOptions(format="openai")))
    assert [r.id for r in records] == ["r"]
    assert rejects[0].field == "custom_id"


def test_duplicate_custom_ids_are_rejected(tmp_path: Path) -> None:
    path = lines(tmp_path / "b.jsonl", [openai_line("same"), openai_line("same")])
    records, rejects = split(read_source(path))
    assert len(records) == 1 and "duplicate" in rejects[0].reason


# --- Parquet ---------------------------------------------------------------------------------


def test_parquet_messages_and_prompt_columns(tmp_path: Path) -> None:
    table = pa.table(
        {
            "id": ["a", None, "c"],
            "messages": [user("m1"), None, [{"role": "user", "content": "m3", "name": None}]],
            "prompt": [None, "p2", None],
        }
    )
    pq.write_table(table, tmp_path / "shard.parquet")
    records, rejects = split(read_source(tmp_path / "shard.parquet"))
    assert rejects == []
    assert [r.id for r in records] == ["a", "shard.parquet:1", "c"]
    assert records[1].messages == user("p2")
    assert records[2].messages == user("m3")  # null struct fields are dropped


def test_parquet_named_columns_and_json_string_messages(tmp_path: Path) -> None:
    table = pa.table(
        {
            "key": [10, 11],
            "conv": [orjson.dumps(user("a")).decode(), orjson.dumps(user("b")).decode()],
        }
    )
    pq.write_table(table, tmp_path / "d.parquet")
    options = ReaderOptions(messages_col="conv", id_col="key")
    records, rejects = split(read_source(tmp_path / "d.parquet", options))
    assert rejects == []
    assert [(r.id, r.messages) for r in records] == [("10", user("a")), ("11", user("b"))]


def test_parquet_directory_of_shards_in_order_streams_many_row_batches(tmp_path: Path) -> None:
    for shard in range(3):
        pq.write_table(
            pa.table({"prompt": [f"{shard}-{i}" for i in range(1500)]}),
            tmp_path / f"part-{shard:02d}.parquet",
            row_group_size=400,
        )
    assert detect_format(tmp_path) == "parquet"
    records, rejects = split(read_source(tmp_path))
    assert rejects == []
    assert len(records) == 4500
    assert records[0].id == "part-00.parquet:0" and records[-1].id == "part-02.parquet:1499"
    assert [r.messages[0]["content"] for r in records[1499:1501]] == ["0-1499", "1-0"]


def test_parquet_shard_without_the_column_is_one_reject_and_others_proceed(tmp_path: Path) -> None:
    pq.write_table(pa.table({"prompt": ["a"]}), tmp_path / "a.parquet")
    pq.write_table(pa.table({"text": ["b", "c"]}), tmp_path / "b.parquet")
    pq.write_table(pa.table({"prompt": ["d"]}), tmp_path / "c.parquet")
    records, rejects = split(read_source(tmp_path))
    assert [r.id for r in records] == ["a.parquet:0", "c.parquet:0"]
    assert len(rejects) == 1
    assert rejects[0].file == str(tmp_path / "b.parquet") and rejects[0].line is None
    assert "'messages'" in rejects[0].reason and "'prompt'" in rejects[0].reason


@pytest.mark.parametrize("flag", ["messages_col", "prompt_col", "id_col"])
def test_parquet_named_column_missing_rejects_the_file(tmp_path: Path, flag: str) -> None:
    pq.write_table(
        pa.table({"messages": [user("a")], "prompt": ["a"], "id": ["x"]}), tmp_path / "f.parquet"
    )
    options = ReaderOptions(**{flag: "nope"})  # type: ignore[arg-type]
    records, rejects = split(read_source(tmp_path / "f.parquet", options))
    assert records == []
    assert (rejects[0].field, rejects[0].line) == ("nope", None)
    assert "no column 'nope'" in rejects[0].reason


def test_parquet_bad_row_values_name_row_and_field(tmp_path: Path) -> None:
    table = pa.table(
        {
            "messages": [
                user("ok"),
                [{"role": "wizard", "content": "x"}],
                [],
                None,
                [{"role": "user", "content": None}],
            ],
            "id": ["a", "b", "c", "d", "e"],
        }
    )
    pq.write_table(table, tmp_path / "rows.parquet")
    records, rejects = split(read_source(tmp_path / "rows.parquet"))
    assert [r.id for r in records] == ["a"]
    assert [(r.line, r.field) for r in rejects] == [
        (1, "messages[0].role"),
        (2, "messages"),
        (3, "messages"),
        (4, "messages[0].content"),
    ]
    assert "row 1" in rejects[0].reason and "unknown role" in rejects[0].reason
    assert all(r.file == str(tmp_path / "rows.parquet") for r in rejects)


def test_parquet_wrong_typed_prompt_and_duplicate_ids(tmp_path: Path) -> None:
    pq.write_table(pa.table({"prompt": [1, 2], "id": ["x", "y"]}), tmp_path / "a.parquet")
    pq.write_table(pa.table({"prompt": ["p", "q"], "id": ["z", "z"]}), tmp_path / "b.parquet")
    records, rejects = split(read_source(tmp_path))
    assert [r.id for r in records] == ["z"]
    assert [(r.field, r.line) for r in rejects] == [("prompt", 0), ("prompt", 1), ("id", 1)]


def test_not_a_parquet_file_is_a_reject(tmp_path: Path) -> None:
    (tmp_path / "bad.parquet").write_bytes(b"not parquet at all")
    pq.write_table(pa.table({"prompt": ["p"]}), tmp_path / "good.parquet")
    records, rejects = split(read_source(tmp_path))
    assert [r.id for r in records] == ["good.parquet:0"]
    assert rejects[0].file.endswith("bad.parquet")


# --- Hugging Face save_to_disk ---------------------------------------------------------------


def test_hf_saved_dataset_over_several_data_files(tmp_path: Path) -> None:
    first = pa.table({"messages": [user("a"), user("b"), user("c")], "id": ["1", "2", None]})
    second = pa.table({"messages": [user("d"), [{"role": "x", "content": "e"}]], "id": [None, "5"]})
    path = save_dataset(tmp_path / "saved", [first, second])
    assert detect_format(path) == "hf"
    records, rejects = split(read_source(path))
    assert [r.id for r in records] == ["1", "2", "saved:2", "saved:3"]
    assert [(r.line, r.field) for r in rejects] == [(4, "messages[0].role")]


def test_hf_dataset_dict_reads_train_else_first_split(tmp_path: Path) -> None:
    root = tmp_path / "dict"
    save_dataset(root / "test", [pa.table({"prompt": ["t"]})], "test")
    save_dataset(root / "train", [pa.table({"prompt": ["a", "b"]})])
    (root / "dataset_dict.json").write_bytes(orjson.dumps({"splits": ["test", "train"]}))
    assert detect_format(root) == "hf"
    records, _ = split(read_source(root))
    assert [r.id for r in records] == ["train:0", "train:1"]

    (root / "dataset_dict.json").write_bytes(orjson.dumps({"splits": ["test"]}))
    records, _ = split(read_source(root, ReaderOptions(format="hf")))
    assert [r.id for r in records] == ["test:0"]


def test_hf_dataset_without_the_column(tmp_path: Path) -> None:
    path = save_dataset(tmp_path / "saved", [pa.table({"text": ["a"]})])
    records, rejects = split(read_source(path))
    assert records == [] and rejects[0].field == "messages"
    records, rejects = split(read_source(path, ReaderOptions(prompt_col="text", id_col="nope")))
    assert records == [] and rejects[0].field == "nope"
    records, rejects = split(read_source(path, ReaderOptions(prompt_col="text")))
    assert [r.id for r in records] == ["saved:0"] and rejects == []


def test_unknown_source(tmp_path: Path) -> None:
    with pytest.raises(InputError, match="no such file"):
        list(read_source(tmp_path / "missing.jsonl"))
    (tmp_path / "data.csv").write_text("a,b\n")
    with pytest.raises(InputError, match="--format"):
        list(read_source(tmp_path / "data.csv"))


def test_byte_order_mark_and_crlf_are_fine(tmp_path: Path) -> None:
    path = tmp_path / "bom.jsonl"
    path.write_bytes(b'\xef\xbb\xbf{"id": "a", "prompt": "x"}\r\n{"id": "b", "prompt": "y"}\r\n')
    records, rejects = split(read_source(path))
    assert [r.id for r in records] == ["a", "b"] and rejects == []


def test_json_array_file(tmp_path: Path) -> None:
    path = tmp_path / "data.json"
    path.write_bytes(
        orjson.dumps([{"id": "a", "prompt": "x"}, {"id": "b"}, {"messages": user("z")}])
    )
    records, rejects = split(read_source(path))
    assert [r.id for r in records] == ["a", "data.json:3"]
    assert [(r.line, r.field) for r in rejects] == [(2, "messages")]
    assert "element 2" in rejects[0].reason


def test_oversized_line_is_skipped_without_losing_the_next(tmp_path: Path) -> None:
    path = tmp_path / "big.jsonl"
    big = orjson.dumps({"id": "big", "prompt": "w " * 50_000})
    path.write_bytes(big + b"\n" + orjson.dumps({"id": "next", "prompt": "ok"}) + b"\n")
    records, rejects = split(read_source(path, ReaderOptions(max_line_bytes=1000)))
    assert [r.id for r in records] == ["next"]
    assert [(r.line, r.reason) for r in rejects] == [(1, "line over 1000 bytes")]


def test_default_ids_are_unique_across_the_files_of_a_folder(tmp_path: Path) -> None:
    shards = tmp_path / "shards"
    shards.mkdir()
    for i in range(2):
        lines(shards / f"part.{i}.jsonl", [{"prompt": f"{i}-{n}"} for n in range(3)])
    lines(shards / "part.1.jsonl.gz", [])  # read as well, and empty
    records, rejects = split(read_source(shards))
    assert rejects == []
    assert [r.id for r in records] == [
        *(f"part.0.jsonl:{n}" for n in (1, 2, 3)),
        *(f"part.1.jsonl:{n}" for n in (1, 2, 3)),
    ]


def test_a_duplicate_id_reject_names_its_file_not_the_folder(tmp_path: Path) -> None:
    lines(tmp_path / "a.jsonl", [{"id": "x", "prompt": "1"}])
    lines(tmp_path / "b.jsonl", [{"prompt": "2"}, {"id": "x", "prompt": "3"}])
    records, rejects = split(read_source(tmp_path))
    assert [r.id for r in records] == ["x", "b.jsonl:1"]
    assert [(r.file, r.line, r.field) for r in rejects] == [(str(tmp_path / "b.jsonl"), 2, "id")]


EVERY_FIELD: dict[str, Any] = {
    "max_completion_tokens": 256,
    "temperature": 0.3,
    "top_p": 0.9,
    "top_k": 20,
    "min_p": 0.05,
    "repetition_penalty": 1.05,
    "presence_penalty": 0.5,
    "frequency_penalty": 0.25,
    "seed": 11,
    "stop": ["\n\n", "END"],
    "response_format": {
        "type": "json_schema",
        "json_schema": {"name": "answer", "schema": {"type": "object"}, "strict": True},
    },
    "logprobs": True,
    "top_logprobs": 2,
    "chat_template_kwargs": {"enable_thinking": False},
}


def test_every_body_field_passes_as_given_less_what_genfleet_owns(tmp_path: Path) -> None:
    body = {**EVERY_FIELD, "stream": True, "stream_options": {"include_usage": True}}
    path = lines(tmp_path / "b.jsonl", [openai_line("r1", **body)])
    (record,), rejects = split(read_source(path))
    assert rejects == []
    expected = {**EVERY_FIELD, "max_tokens": 256}
    del expected["max_completion_tokens"]
    assert record.params == expected  # no model, no stream: genfleet's


def test_n_becomes_samples_each_with_its_own_seed(tmp_path: Path) -> None:
    path = lines(
        tmp_path / "b.jsonl",
        [openai_line("r1", n=3, seed=5), openai_line("r2", n=2), openai_line("r3", n=1)],
    )
    records, rejects = split(read_source(path))
    assert rejects == []
    assert [(r.id, r.sample) for r in records] == [
        ("r1", 0), ("r1", 1), ("r1", 2), ("r2", 0), ("r2", 1), ("r3", 0)
    ]  # fmt: skip
    assert [r.params for r in records[:3]] == [{"seed": 5}, {"seed": 6}, {"seed": 7}]
    assert all(r.params is None for r in records[3:])


def test_samples_of_a_seeded_body_each_get_their_own_seed(tmp_path: Path) -> None:
    path = lines(tmp_path / "b.jsonl", [openai_line("r1", seed=5), openai_line("r2", n=2, seed=9)])
    records, rejects = split(read_source(path, ReaderOptions(samples=3)))
    assert rejects == []
    seeds = [(r.id, r.sample, (r.params or {})["seed"]) for r in records]
    assert seeds[:3] == [("r1", 0, 5), ("r1", 1, 6), ("r1", 2, 7)]  # not three equal answers
    assert [seed for _, _, seed in seeds[3:]] == [9, 10, 11, 12, 13, 14]


@pytest.mark.parametrize(
    ("body", "field", "reason"),
    [
        ({"tools": [{"type": "function"}]}, "body.tools", "tool calls are not kept"),
        ({"tool_choice": "auto"}, "body.tool_choice", "not supported"),
        ({"audio": {"voice": "x"}}, "body.audio", "not supported"),
        ({"metadata": {"a": "b"}}, "body.metadata", "unknown field"),
        ({"temprature": 0.1}, "body.temprature", "unknown field"),
        ({"n": 0}, "body.n", "from 1 to 128"),
        ({"top_k": 2.5}, "body.top_k", "an integer"),
        ({"stop": [1]}, "body.stop", "list of strings"),
        ({"top_logprobs": 3}, "body.top_logprobs", "needs logprobs"),
        ({"response_format": {"type": "xml"}}, "body.response_format", "json_schema"),
        ({"response_format": {"type": "json_schema"}}, "body.response_format", "json_schema"),
        ({"chat_template_kwargs": "off"}, "body.chat_template_kwargs", "an object"),
    ],
)
def test_a_field_genfleet_cannot_honour_rejects_the_line(
    tmp_path: Path, body: dict[str, Any], field: str, reason: str
) -> None:
    path = lines(tmp_path / "b.jsonl", [openai_line("ok"), openai_line("bad", **body)])
    records, rejects = split(read_source(path))
    assert [r.id for r in records] == ["ok"]
    (reject,) = rejects
    assert (reject.file, reject.line, reject.field) == (str(path), 2, field)
    assert reason in reject.reason


def test_a_parquet_file_corrupt_mid_file_loses_only_its_bad_row_group_and_says_how_many(
    tmp_path: Path,
) -> None:
    path = corrupt_parquet(tmp_path / "data.parquet", 500, 100, bad_group=2)
    records, rejects = split(read_source(path))
    assert [r.id for r in records] == [f"p{i:04d}" for i in [*range(200), *range(300, 500)]]
    (reject,) = rejects
    assert (reject.truncated, reject.rows_unread) == (True, 100)
    assert reject.to_json()["rows_unread"] == 100


def test_a_saved_dataset_corrupt_mid_file_says_how_many_rows_were_not_read(
    tmp_path: Path,
) -> None:
    tables = [pa.table({"prompt": [f"q{j}-{i}" for i in range(6)]}) for j in range(2)]
    path = save_dataset(tmp_path / "saved", tables)
    info = {"features": {}, "splits": {"train": {"name": "train", "num_examples": 12}}}
    (path / "dataset_info.json").write_bytes(orjson.dumps(info))
    second = path / "data-00001-of-00002.arrow"
    second.write_bytes(second.read_bytes()[: second.stat().st_size // 2])  # cut mid-file

    records, rejects = split(read_source(path))

    assert 6 <= len(records) < 12
    (reject,) = rejects
    assert (reject.truncated, reject.rows_unread) == (True, 12 - len(records))


# --- Named columns mean what they say --------------------------------------------------------
# MT-bench-like rows beside a chat field: the column named is the one read, on every line.
BOTH = [
    {"question_id": 81, "question": "What is 17 * 23?", "messages": user("Translate: hi")},
    {"question_id": 82, "question": "Name a prime.", "conversations": user("ignored")},
]


def test_jsonl_prompt_col_is_obeyed_over_a_chat_field(tmp_path: Path) -> None:
    path = lines(tmp_path / "q.jsonl", BOTH)
    options = ReaderOptions(prompt_col="question", id_col="question_id")
    records, rejects = split(read_source(path, options))
    assert rejects == []
    assert [(r.id, r.messages) for r in records] == [
        ("81", user("What is 17 * 23?")),
        ("82", user("Name a prime.")),
    ]


def test_parquet_prompt_col_is_obeyed_over_a_messages_column(tmp_path: Path) -> None:
    table = pa.table(
        {
            "question_id": [81, 82],
            "question": ["What is 17 * 23?", "Name a prime."],
            "messages": [user("Translate: hi"), user("ignored")],
        }
    )
    pq.write_table(table, tmp_path / "q.parquet")
    options = ReaderOptions(prompt_col="question", id_col="question_id")
    records, rejects = split(read_source(tmp_path / "q.parquet", options))
    assert rejects == []
    assert [r.messages for r in records] == [user("What is 17 * 23?"), user("Name a prime.")]


def test_null_values_in_named_columns_are_rejects_naming_line_and_field(tmp_path: Path) -> None:
    path = lines(
        tmp_path / "q.jsonl",
        [
            {"key": "a", "question": "fine"},
            {"key": None, "question": "no id"},
            {"key": "c", "question": None, "messages": user("not read")},
            {"question": "id missing"},
        ],
    )
    records, rejects = split(read_source(path, ReaderOptions(prompt_col="question", id_col="key")))
    assert [r.id for r in records] == ["a"]
    assert [(r.line, r.field) for r in rejects] == [(2, "key"), (3, "question"), (4, "key")]
    assert "is null" in rejects[0].reason and "--id-col" in rejects[0].reason
    assert "is null" in rejects[1].reason
    table = pa.table({"key": ["a", None], "question": ["fine", "no id"]})
    pq.write_table(table, tmp_path / "q.parquet")
    records, rejects = split(
        read_source(tmp_path / "q.parquet", ReaderOptions(prompt_col="question", id_col="key"))
    )
    assert [r.id for r in records] == ["a"]
    assert [(r.field, "is null" in r.reason) for r in rejects] == [("key", True)]


# --- The row's own system prompt (ShareGPT `system`, OpenOrca `system_prompt`) ---------------
PIRATE = "You are a pirate. Answer in pirate speak."


def test_a_rows_system_prompt_beside_its_turns_reaches_the_prompt(tmp_path: Path) -> None:
    path = lines(
        tmp_path / "sharegpt.jsonl",
        [
            {"id": "a", "system": PIRATE, "conversations": [{"from": "human", "value": "hi"}]},
            {"id": "b", "system": "", "conversations": [{"from": "human", "value": "plain"}]},
            {
                "id": "c",
                "system": PIRATE,
                "conversations": [
                    {"from": "system", "value": PIRATE},
                    {"from": "human", "value": "once"},
                ],
            },
            {"id": "d", "system_prompt": PIRATE, "question": "Where is the gold?"},
        ],
    )
    records, rejects = split(read_source(path))
    assert rejects[0].line == 4  # `question` is read only when named
    system = {"role": "system", "content": PIRATE}
    assert [r.messages for r in records] == [
        [system, *user("hi")],
        user("plain"),
        [system, *user("once")],
    ]
    records, rejects = split(read_source(path, ReaderOptions(prompt_col="question")))
    assert [(r.id, r.messages) for r in records] == [("d", [system, *user("Where is the gold?")])]


def test_two_different_system_prompts_are_the_lines_reject(tmp_path: Path) -> None:
    path = lines(
        tmp_path / "sharegpt.jsonl",
        [
            {
                "system": PIRATE,
                "conversations": [
                    {"from": "system", "value": "Be brief."},
                    {"from": "human", "value": "hi"},
                ],
            },
            {"system": PIRATE, "system_prompt": "Be brief.", "messages": user("hi")},
            {"system": 7, "messages": user("hi")},
        ],
    )
    records, rejects = split(read_source(path))
    assert records == []
    assert [(r.line, r.field) for r in rejects] == [
        (1, "system"),
        (2, "system_prompt"),
        (3, "system"),
    ]


def test_parquet_rows_keep_their_system_column(tmp_path: Path) -> None:
    table = pa.table(
        {
            "system": [PIRATE, None],
            "conversations": [
                [{"from": "human", "value": "hi"}],
                [{"from": "human", "value": "plain"}],
            ],
        }
    )
    pq.write_table(table, tmp_path / "sharegpt.parquet")
    records, rejects = split(read_source(tmp_path / "sharegpt.parquet"))
    assert rejects == []
    assert [r.messages for r in records] == [
        [{"role": "system", "content": PIRATE}, *user("hi")],
        user("plain"),
    ]


# --- Shapes of published sets, read by their fields (common/readers/shapes.py) ---------------
DATA = Path(__file__).resolve().parents[1] / "data"


def test_alpaca_as_published_keeps_its_input_and_its_old_answer() -> None:
    path = DATA / "alpaca_data.sample.json"
    published = orjson.loads(path.read_bytes())
    records, rejects = split(read_source(path, ReaderOptions(regenerate=True)))
    assert rejects == [] and len(records) == len(published) == 10
    for record, row in zip(records, published, strict=True):
        prompt = row["instruction"] + (f"\n\n{row['input']}" if row["input"].strip() else "")
        assert record.messages == user(prompt)  # no input dropped, none invented
        assert record.previous is not None and record.previous["content"] == row["output"]
    assert sum(1 for row in published if row["input"].strip()) == 7  # the inputs were there


def test_alpaca_without_regenerate_names_the_flag_that_reads_it() -> None:
    records, rejects = split(read_source(DATA / "alpaca_data.sample.json"))
    assert records == []
    assert {r.field for r in rejects} == {"output"}
    assert all("--regenerate" in r.reason for r in rejects)


@pytest.mark.parametrize(
    ("row", "prompt", "old"),
    [
        (
            {"instruction": "Summarize.", "context": "A long text.", "response": "Short.",
             "category": "summarization"},
            "Summarize.\n\nA long text.",
            "Short.",
        ),
        ({"instruction": "Name a color.", "context": "", "response": "Red."},
         "Name a color.", "Red."),
        ({"query": "2+2?", "response": "4"}, "2+2?", "4"),
        ({"question": "Capital of France?", "response": "Paris.", "system_prompt": ""},
         "Capital of France?", "Paris."),
    ],
)  # fmt: skip
def test_dolly_openorca_and_query_response_shapes(
    tmp_path: Path, row: dict[str, Any], prompt: str, old: str
) -> None:
    path = lines(tmp_path / "set.jsonl", [row])
    records, rejects = split(read_source(path, ReaderOptions(regenerate=True)))
    assert rejects == []
    assert records[0].messages == user(prompt)
    assert records[0].previous is not None and records[0].previous["content"] == old


def test_openorca_keeps_its_system_prompt(tmp_path: Path) -> None:
    row = {"id": "niv.1", "system_prompt": PIRATE, "question": "Where?", "response": "Arr."}
    records, _ = split(
        read_source(lines(tmp_path / "o.jsonl", [row]), ReaderOptions(regenerate=True))
    )
    assert records[0].messages == [{"role": "system", "content": PIRATE}, *user("Where?")]


def test_mt_bench_turns_and_unknown_rows_are_refused_saying_why(tmp_path: Path) -> None:
    path = lines(
        tmp_path / "q.jsonl",
        [
            {
                "question_id": 81,
                "category": "writing",
                "turns": ["Write a blog post.", "Rewrite it."],
            },
            {"text": "hello", "label": 1},
        ],
    )
    records, rejects = split(read_source(path))
    assert records == []
    assert rejects[0].field == "turns" and "MT-bench" in rejects[0].reason
    assert "keys: label, text" in rejects[1].reason and "--prompt-col" in rejects[1].reason


@pytest.mark.parametrize(
    ("turns", "field", "reason"),
    [
        ([], "turns", "empty list"),
        ([{"text": "q"}], "turns[0]", "must be a string"),
        (["  ", "Rewrite it."], "turns[0]", "is empty"),
    ],
)
def test_first_turn_refuses_a_row_with_no_first_turn_to_ask(
    tmp_path: Path, turns: list[Any], field: str, reason: str
) -> None:
    good = {"question_id": 81, "turns": ["Write a blog post.", "Rewrite it."]}
    path = lines(tmp_path / "q.jsonl", [good, {"question_id": 82, "turns": turns}])
    records, rejects = split(read_source(path, ReaderOptions(first_turn=True)))
    assert [r.messages for r in records] == [user("Write a blog post.")]
    assert [(r.line, r.field) for r in rejects] == [(2, field)] and reason in rejects[0].reason


def test_parquet_of_mt_bench_reads_the_first_turn_with_first_turn(tmp_path: Path) -> None:
    rows = [orjson.loads(line) for line in (DATA / "mt_bench_question.sample.jsonl").open("rb")]
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "mt.parquet")
    records, rejects = split(read_source(tmp_path / "mt.parquet"))
    assert records == [] and "--first-turn" in rejects[0].reason
    records, rejects = split(read_source(tmp_path / "mt.parquet", ReaderOptions(first_turn=True)))
    assert rejects == [] and [r.messages for r in records] == [user(r["turns"][0]) for r in rows]
    assert all(r.previous is None for r in records)


def test_parquet_of_a_published_shape_is_read_by_its_columns(tmp_path: Path) -> None:
    published = orjson.loads((DATA / "alpaca_data.sample.json").read_bytes())
    pq.write_table(pa.Table.from_pylist(published), tmp_path / "alpaca.parquet")
    records, rejects = split(
        read_source(tmp_path / "alpaca.parquet", ReaderOptions(regenerate=True))
    )
    assert rejects == [] and len(records) == 10
    for record, row in zip(records, published, strict=True):
        prompt = row["instruction"] + (f"\n\n{row['input']}" if row["input"].strip() else "")
        assert record.messages == user(prompt)
        assert record.previous is not None and record.previous["content"] == row["output"]
    # A Dolly file without a context column: instruction and response alone.
    table = pa.table({"instruction": ["Name a color."], "response": ["Red."]})
    pq.write_table(table, tmp_path / "dolly.parquet")
    records, rejects = split(
        read_source(tmp_path / "dolly.parquet", ReaderOptions(regenerate=True))
    )
    assert rejects == [] and records[0].messages == user("Name a color.")
    # An unknown file: refused naming its columns and the options.
    pq.write_table(pa.table({"text": ["x"]}), tmp_path / "other.parquet")
    records, rejects = split(read_source(tmp_path / "other.parquet"))
    assert records == [] and "'text'" in rejects[0].reason and "--prompt-col" in rejects[0].reason


# --- Files as they come: what the name says and what the bytes are ---------------------------
def test_files_are_read_as_what_they_are_not_what_their_names_say(tmp_path: Path) -> None:
    import zstandard

    rows = [{"id": "a", "prompt": "one"}, {"id": "b", "prompt": "two"}]
    body = b"".join(orjson.dumps(r) + b"\n" for r in rows)
    (tmp_path / "array.jsonl").write_bytes(orjson.dumps(rows))  # a JSON array named .jsonl
    (tmp_path / "gzipped.jsonl").write_bytes(gzip.compress(body))  # gzip without .gz
    (tmp_path / "zstd.jsonl").write_bytes(zstandard.ZstdCompressor().compress(body))
    (tmp_path / "array.json.gz").write_bytes(gzip.compress(orjson.dumps(rows)))
    for name in ("array.jsonl", "gzipped.jsonl", "zstd.jsonl", "array.json.gz"):
        records, rejects = split(read_source(tmp_path / name))
        assert rejects == [], name
        assert [(r.id, r.messages) for r in records] == [("a", user("one")), ("b", user("two"))]


def test_an_empty_file_is_named_as_such(tmp_path: Path) -> None:
    (tmp_path / "empty.jsonl").write_bytes(b"\n\n")
    records, rejects = split(read_source(tmp_path / "empty.jsonl"))
    assert records == [] and [r.reason for r in rejects] == ["an empty file: no line to read"]


def test_a_conversation_of_only_a_system_turn_is_not_sent(tmp_path: Path) -> None:
    system_only = [{"role": "system", "content": PIRATE}]
    path = lines(
        tmp_path / "s.jsonl",
        [
            {"id": "a", "messages": system_only},
            {"id": "b", "system": PIRATE, "conversations": []},
            {"custom_id": "c", "body": {"messages": system_only}},
        ],
    )
    records, rejects = split(read_source(path))
    assert records == []
    assert [(r.line, r.field) for r in rejects] == [
        (1, "messages"),
        (2, "conversations"),
        (3, "body.messages"),
    ]
    assert "only a system turn" in rejects[0].reason
