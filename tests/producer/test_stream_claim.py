"""A source that can be read once (a named pipe, /dev/stdin) is staged in one pass: its claim
records no fingerprint, so an interrupted staging of it is refused, never finished with what
the stream gives the second time."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from genfleet.common.errors import RunMismatch
from genfleet.common.routing import ModelRef
from genfleet.common.store import open_store
from genfleet.producer.runs.identity import claim_run, is_stream
from tests.support.core import PARAMS

REF = ModelRef("emulator", "emulator")


def test_pipes_and_devices_are_streams_and_files_are_not(tmp_path: Path) -> None:
    pipe = tmp_path / "pipe"
    os.mkfifo(pipe)
    plain = tmp_path / "plain.jsonl"
    plain.write_text("{}\n")
    assert is_stream(str(pipe)) and is_stream("/dev/null")
    assert not is_stream(str(plain)) and not is_stream(str(tmp_path))
    assert not is_stream("s3://bucket/data.jsonl") and not is_stream(str(tmp_path / "missing"))


@pytest.mark.parametrize("second", [None, "a" * 64])
def test_an_interrupted_staging_of_a_stream_is_refused(tmp_path: Path, second: str | None) -> None:
    store = open_store(tmp_path.as_uri())
    first = claim_run(store, "r", PARAMS, REF, {"batch_size": 4}, None, "/dev/stdin")
    assert first
    with pytest.raises(RunMismatch, match="stream"):
        claim_run(store, "r", PARAMS, REF, {"batch_size": 4}, second, "/dev/stdin")


def test_a_file_claimed_again_with_the_same_data_keeps_its_staging(tmp_path: Path) -> None:
    store = open_store(tmp_path.as_uri())
    first = claim_run(store, "r", PARAMS, REF, {"batch_size": 4}, "f" * 64, "data.jsonl")
    assert claim_run(store, "r", PARAMS, REF, {"batch_size": 4}, "f" * 64, "data.jsonl") == first
