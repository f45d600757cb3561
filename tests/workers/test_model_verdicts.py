"""Whether a worker serves a run's model: the model the producer recorded at staging
(`model_identity.asked`) against the identity the worker computes at start
(`fingerprint.checkpoint_identity`), judged by `model_identity.judge`; and what a worker
remembers of its verdicts (`workers.refusals`).

Each row gives the producer's settings and the worker's; `{A}`, `{A2}`, `{B}` and `{FP8}` are
checkpoint folders: A2 is a copy of A at another path, B holds other weights of A's sizes
under A's file names, FP8 is quantized in its own config.
"""

from __future__ import annotations

import shutil
import threading
from pathlib import Path
from typing import Any

import orjson
import pytest

from genfleet.common.model_identity import UNRECORDED, Verdict, asked, judge
from genfleet.common.settings import Settings
from genfleet.workers.engine.families import choose
from genfleet.workers.engine.fingerprint import checkpoint_identity
from genfleet.workers.refusals import RunVerdicts

QWEN = '{"architectures": ["Qwen3ForCausalLM"]'
WEIGHTS_BYTES = 4 << 20  # four MiB: the digest samples its start, middle and end


def checkpoint(folder: Path, fill: bytes, config: str = QWEN + "}") -> Path:
    folder.mkdir(parents=True)
    (folder / "config.json").write_text(config)
    (folder / "model.safetensors.index.json").write_text(
        '{"weight_map": {"w": "model.safetensors"}}'
    )
    (folder / "model.safetensors").write_bytes(fill * WEIGHTS_BYTES)
    return folder


@pytest.fixture
def folders(tmp_path: Path) -> dict[str, str]:
    a = checkpoint(tmp_path / "a" / "Qwen3-8B", b"a")
    shutil.copytree(a, tmp_path / "a2" / "Qwen3-8B")
    checkpoint(tmp_path / "b" / "Qwen3-8B", b"b")
    fp8 = QWEN + ', "quantization_config": {"quant_method": "fp8"}}'
    checkpoint(tmp_path / "fp8", b"f", fp8)
    return {
        "A": str(a),
        "A2": str(tmp_path / "a2" / "Qwen3-8B"),
        "B": str(tmp_path / "b" / "Qwen3-8B"),
        "FP8": str(tmp_path / "fp8"),
    }


def settings_of(values: dict[str, Any], folders: dict[str, str]) -> Settings:
    return Settings(
        **{k: v.format(**folders) if isinstance(v, str) else v for k, v in values.items()}
    )


def worker_identity(settings: Settings) -> dict[str, Any]:
    """What the worker computes at start: the architecture read from its config (preflight's
    reading), else none (a hub id: its family from the name)."""
    config = Path(settings.model or "/-") / "config.json"
    arch = orjson.loads(config.read_bytes())["architectures"][0] if config.is_file() else None
    return checkpoint_identity(settings, choose(settings, arch))


def verdict_of(
    producer: dict[str, Any], worker: dict[str, Any], folders: dict[str, str]
) -> Verdict:
    recorded = asked(settings_of(producer, folders))
    return judge(recorded, worker_identity(settings_of(worker, folders)))


Q = {"served_model_name": "q"}  # one served name: one queue, whatever the checkpoint

# id, producer settings, worker settings, serves, fields named in the refusal, compared by
CASES: list[tuple[str, dict[str, Any], dict[str, Any], bool, list[str], str]] = [
    ("the emulator as asked", {}, {}, True, [], "name"),
    (
        "a worker of another --quantization",
        {},
        {"engine_extra_args": "--quantization fp8"},
        False,
        ["quantization"],
        "name",
    ),
    (
        "both ask fp8, written two ways",
        {"engine_extra_args": "--quantization fp8 --foo"},
        {"engine_extra_args": "--quantization=fp8"},
        True,
        [],
        "name",
    ),
    (
        "the run asks fp8, the worker serves none",
        {"engine_extra_args": "--quantization fp8"},
        {},
        False,
        ["quantization"],
        "name",
    ),
    (
        "another reasoning parser",
        {},
        {"reasoning_parser": "deepseek-r1"},
        False,
        ["reasoning_parser"],
        "name",
    ),
    ("the family's own parser, named", {}, {"reasoning_parser": "qwen3"}, True, [], "name"),
    ("the run names the family's parser", {"reasoning_parser": "qwen3"}, {}, True, [], "name"),
    (
        "the run asks no parser",
        {"reasoning_parser": "none"},
        {},
        False,
        ["reasoning_parser"],
        "name",
    ),
    (
        "a worker with no thinking switch",
        {},
        {"thinking_switch": "none"},
        False,
        ["thinking_switch"],
        "name",
    ),
    ("the same hub id", {"model": "Qwen/Qwen3-8B"}, {"model": "Qwen/Qwen3-8B"}, True, [], "name"),
    (
        "two hub ids under one served name",
        {"model": "Qwen/Qwen3-8B", **Q},
        {"model": "Qwen/Qwen3-8B-FP8", **Q},
        False,
        ["checkpoint"],
        "name",
    ),
    (
        "one snapshot at two paths",
        {"model": "{A}", **Q},
        {"model": "{A2}", **Q},
        True,
        [],
        "content",
    ),
    (
        "other weights under one name",
        {"model": "{A}", **Q},
        {"model": "{B}", **Q},
        False,
        ["checkpoint content"],
        "content",
    ),
    (
        "a hub id against a local snapshot",
        {"model": "Qwen/Qwen3-8B", **Q},
        {"model": "{A}", **Q},
        True,
        [],
        "name",
    ),
    (
        "a local snapshot against a hub id",
        {"model": "{A}", **Q},
        {"model": "Qwen/Qwen3-8B", **Q},
        True,
        [],
        "name",
    ),
    (
        "a checkpoint quantized in its config",
        {"model": "{FP8}"},
        {"model": "{FP8}"},
        True,
        [],
        "content",
    ),
    (
        "that checkpoint forced to awq on one worker",
        {"model": "{FP8}"},
        {"model": "{FP8}", "engine_extra_args": "--quantization awq"},
        False,
        ["quantization"],
        "content",
    ),
    (
        "another model on the same engine",
        {"model": "Qwen/Qwen3-8B"},
        {"model": "Qwen/Qwen3-14B"},
        False,
        ["model", "checkpoint"],
        "name",
    ),
]


@pytest.mark.parametrize(
    ("producer", "worker", "serves", "named", "compared"),
    [case[1:] for case in CASES],
    ids=[case[0] for case in CASES],
)
def test_a_worker_serves_a_run_only_as_the_run_asked(
    producer: dict[str, Any],
    worker: dict[str, Any],
    serves: bool,
    named: list[str],
    compared: str,
    folders: dict[str, str],
) -> None:
    verdict = verdict_of(producer, worker, folders)

    assert verdict.serves is serves, verdict.why()
    assert verdict.compared == compared
    assert [d.split(":")[0] for d in verdict.differences] == named


@pytest.mark.parametrize(
    ("producer", "worker", "unread"),
    [
        ({"model": "Qwen/Qwen3-8B", **Q}, {"model": "{A}", **Q}, "by name only"),
        ({"model": "{A}", **Q}, {"model": "Qwen/Qwen3-8B", **Q}, "is a name only"),
    ],
)
def test_a_name_against_content_is_judged_by_name_and_says_so(
    producer: dict[str, Any], worker: dict[str, Any], unread: str, folders: dict[str, str]
) -> None:
    verdict = verdict_of(producer, worker, folders)

    assert verdict.serves and "content not compared" in verdict.note and unread in verdict.note
    assert "by name" in verdict.why()


def test_a_refusal_names_both_sides_of_each_difference(folders: dict[str, str]) -> None:
    verdict = verdict_of({}, {"engine_extra_args": "--quantization fp8"}, folders)

    assert verdict.differences == (
        "quantization: the run asks its own (None), this worker serves 'fp8'",
    )


def test_runs_staged_before_runs_recorded_their_model_are_judged_as_they_were() -> None:
    mine = worker_identity(Settings())
    assert judge(None, mine) == Verdict(True, "name", (), UNRECORDED)
    legacy = {k: mine[k] for k in ("engine", "model", "reasoning_parser", "thinking_switch")}
    legacy |= {"quantization": None, "thinking_default": True, "fingerprint": "f" * 64}
    legacy |= {"config_sha256": None, "weights_index_sha256": None}
    assert judge(legacy, mine).serves
    other = judge({**legacy, "reasoning_parser": "deepseek-r1"}, mine)
    assert not other.serves and other.differences[0].startswith("reasoning_parser:")


def test_the_content_digest_follows_the_weights_not_the_path(
    folders: dict[str, str], tmp_path: Path
) -> None:
    def content(folder: str) -> str | None:
        return worker_identity(Settings(model=folder))["content_sha256"]

    assert content(folders["A"]) == content(folders["A2"]) is not None
    assert content(folders["A"]) != content(folders["B"])  # same names and sizes
    moved = Path(folders["A2"]) / "model.safetensors"
    data = bytearray(moved.read_bytes())
    data[len(data) // 2] ^= 1  # one byte in the middle sample
    moved.write_bytes(bytes(data))
    assert content(folders["A2"]) != content(folders["A"])
    assert content("Qwen/Qwen3-8B") is None  # a hub id: a name only
    assert content(str(tmp_path / "empty")) is None


def test_a_worker_remembers_a_refusal_for_a_while_and_a_served_run_for_good() -> None:
    now = [0.0]
    verdicts = RunVerdicts(memory_s=60.0, clock=lambda: now[0])
    refused, served = Verdict(False, "name", ("quantization: …",)), Verdict(True, "name")
    assert verdicts.remember("a", "s1", refused) is True
    assert verdicts.remember("b", "s1", served) is True
    now[0] = 59.0
    assert verdicts.known("a", "s1") == refused and verdicts.known("a", "s2") is None
    now[0] = 61.0
    assert verdicts.known("a", "s1") is None  # judged again: one store read
    assert verdicts.known("b", "s1") == served
    assert verdicts.remember("a", "s1", refused) is True  # the refusal is news again


def test_batch_slots_that_judge_a_run_at_once_say_so_once() -> None:
    """Every slot found nothing known and judged the run: one of them tells (one finding),
    the others only remember."""
    verdicts = RunVerdicts(memory_s=60.0)
    refused = Verdict(False, "name", ("quantization: …",))
    start = threading.Barrier(8)
    firsts: list[bool] = []

    def slot() -> None:
        start.wait()
        assert verdicts.known("a", "s1") in (None, refused)
        firsts.append(verdicts.remember("a", "s1", refused))

    threads = [threading.Thread(target=slot) for _ in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert sorted(firsts) == [False] * 7 + [True]
