"""A run's identity and its model's queue: pure functions, tables."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import pytest

from genfleet.common.manifest import RunIdentity
from genfleet.common.routing import (
    ModelRef,
    model_ref,
    order_queue,
    queue_slug,
    work_queue,
    worker_queue,
)
from genfleet.common.settings import Settings
from genfleet.producer.local_run import default_run_name


@pytest.mark.parametrize(
    ("settings", "expected"),
    [
        ({}, ModelRef("emulator", "emulator")),
        ({"engine": "emulator", "model": "/m/x"}, ModelRef("emulator", "emulator")),
        ({"model": "/models/Qwen3.6-27B"}, ModelRef("sglang", "/models/Qwen3.6-27B")),
        ({"model": "/models/q", "served_model_name": "q"}, ModelRef("sglang", "q")),
        ({"engine": "external", "engine_url": "http://h:1/"}, ModelRef("external", "http://h:1")),
        (
            {"engine": "external", "engine_url": "http://h:1", "served_model_name": "q"},
            ModelRef("external", "q"),
        ),
        (
            {"engine": "command", "engine_command": "serve {port}"},
            ModelRef("command", "serve {port}"),
        ),
    ],
)
def test_model_ref(settings: dict[str, Any], expected: ModelRef) -> None:
    assert model_ref(Settings(**settings)) == expected


def test_queue_names_are_readable_and_never_shared() -> None:
    assert work_queue("gpu", ModelRef("emulator", "emulator")) == "gpu.emulator"
    assert work_queue("gpu", ModelRef("sglang", "qwen3")) == "gpu.qwen3"
    assert work_queue("gpu", ModelRef("external", "qwen3")) == "gpu.qwen3"  # one model, one queue
    a = queue_slug("/a/Qwen3.6-27B")
    b = queue_slug("/b/Qwen3.6-27B")
    assert a.startswith("Qwen3.6-27B-") and b.startswith("Qwen3.6-27B-") and a != b
    assert queue_slug("Qwen/Qwen3-8B").startswith("Qwen3-8B-")
    # a real model served under the name "emulator" never lands on the emulator's queue
    assert work_queue("gpu", ModelRef("sglang", "emulator")) != "gpu.emulator"
    assert worker_queue(Settings(model="/a/Qwen3.6-27B")) == f"gpu.{a}"
    assert worker_queue(Settings(queue="bench-1")) == "bench-1.emulator"
    order = {"engine": "sglang", "model": "/a/Qwen3.6-27B"}
    assert order_queue("gpu", order) == worker_queue(Settings(model="/a/Qwen3.6-27B"))


BASE = RunIdentity(
    fingerprint="f" * 64,
    params={"max_tokens": 1024, "temperature": 0.6, "top_p": 0.95, "thinking": True},
    staging={"batch_size": 20, "batch_max_tokens": 4_000_000},
    model="emulator",
    engine="emulator",
    source="examples/prompts.jsonl",
)


@pytest.mark.parametrize(
    ("change", "expected"),
    [
        ({}, []),
        ({"source": "elsewhere/prompts.jsonl"}, []),  # the same data moved: the same run
        ({"fingerprint": "e" * 64}, ["prompts: the run holds examples/prompts.jsonl"]),
        ({"params": {**BASE.params, "max_tokens": 5}}, ["max_tokens: the run has 1024, now 5"]),
        ({"params": {**BASE.params, "top_k": 20}}, ["top_k: the run has (not recorded), now 20"]),
        ({"staging": {**BASE.staging, "batch_size": 7}}, ["batch_size: the run has 20, now 7"]),
        (
            {"engine": "sglang", "model": "/m/q"},
            ["engine: the run has 'emulator', now 'sglang'", "model: the run has 'emulator'"],
        ),
    ],
)
def test_differences_name_each_field(change: dict[str, Any], expected: list[str]) -> None:
    new = dataclasses.replace(BASE, **change)
    found = BASE.differences(new)
    assert len(found) == len(expected)
    for line, start in zip(found, expected, strict=True):
        assert line.startswith(start), (line, start)


@pytest.mark.parametrize(
    ("source", "run"),
    [
        ("examples/prompts.jsonl", "prompts"),
        ("data/prompts.v2.jsonl", "prompts.v2"),
        ("data.jsonl.gz", "data"),
        ("shards.v1.parquet", "shards.v1"),
        ("my data (1).jsonl", "my-data--1"),
        ("noext", "noext"),
    ],
)
def test_default_run_name_is_the_file_name_without_its_extension(source: str, run: str) -> None:
    assert default_run_name(source) == run


def test_default_run_name_of_a_folder_is_its_name(tmp_path: Path) -> None:
    folder = tmp_path / "shards.v3"
    folder.mkdir()
    assert default_run_name(str(folder) + "/") == "shards.v3"
