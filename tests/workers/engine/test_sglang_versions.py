"""Every flag the argv builder emits exists in that SGLang release's own argument definitions.

The wheels are read as zip files, never imported (sglang needs a GPU stack to import). Flags
come from two places, one per era:

- `parser.add_argument("--x", ...)` calls (all of 0.5.11's flags, later the dynamic ones and
  deprecated aliases);
- `Annotated` dataclass fields (`name: A[T, Arg(...)]`), which 0.5.14+ turn into
  `--name-with-dashes` in `arg_groups/arg_utils.py::_field_to_cli_name`, honouring `cli_name`,
  `aliases` and `no_cli`.
"""

from __future__ import annotations

import ast
import os
import subprocess
import sys
import zipfile
from functools import cache
from pathlib import Path
from typing import Any

import orjson
import pytest

from genfleet.common.settings import Settings
from genfleet.workers.engine.families import HYBRID_ARCHS
from genfleet.workers.engine.sglang_argv import (
    NEWEST_SGLANG,
    OLDEST_SGLANG,
    parse_release,
    sglang_launch,
)

pytestmark = [pytest.mark.integration, pytest.mark.slow]

VERSIONS = [OLDEST_SGLANG, NEWEST_SGLANG]
WHEEL_CACHE = Path.home() / ".cache" / "genfleet" / "wheels"
QWEN35 = "Qwen3_5ForConditionalGeneration"


def wheel(version: str) -> Path:
    """The sglang wheel for `version`, downloaded once into the cache (no dependencies)."""
    WHEEL_CACHE.mkdir(parents=True, exist_ok=True)
    found = sorted(WHEEL_CACHE.glob(f"sglang-{version}-*.whl"))
    if found:
        return found[0]
    command = [
        sys.executable, "-m", "pip", "download", "--quiet", "--no-deps",
        "--only-binary=:all:", f"sglang=={version}", "-d", str(WHEEL_CACHE),
    ]  # fmt: skip
    result = subprocess.run(command, capture_output=True, text=True, timeout=600)
    found = sorted(WHEEL_CACHE.glob(f"sglang-{version}-*.whl"))
    if result.returncode != 0 or not found:
        reason = f"cannot download sglang=={version}: {result.stderr.strip()[-2000:]}"
        if os.environ.get("CI"):
            pytest.fail(reason)
        pytest.skip(reason)
    return found[0]


@cache
def wheel_flags(version: str) -> frozenset[str]:
    """Every `--flag` the release defines, read from `sglang/srt/**.py` in its wheel."""
    flags: set[str] = set()
    with zipfile.ZipFile(wheel(version)) as archive:
        for name in archive.namelist():
            if not (name.startswith("sglang/srt/") and name.endswith(".py")):
                continue
            source = archive.read(name).decode("utf-8")
            if "add_argument" in source or "A[" in source or "Annotated[" in source:
                flags |= flags_in_source(source, name)
    return frozenset(flags)


def flags_in_source(source: str, filename: str) -> set[str]:
    flags: set[str] = set()
    for node in ast.walk(ast.parse(source, filename)):
        if isinstance(node, ast.Call) and _called(node) == "add_argument":
            flags |= {arg for arg in _strings(node.args) if arg.startswith("--")}
        elif isinstance(node, ast.ClassDef):
            for statement in node.body:
                flags |= _field_flags(statement)
    return flags


def _field_flags(statement: ast.stmt) -> set[str]:
    """`tp_size: A[int, Arg(aliases=["--tensor-parallel-size"])]` → {--tp-size, --tensor-…}."""
    if not (isinstance(statement, ast.AnnAssign) and isinstance(statement.target, ast.Name)):
        return set()
    annotation = statement.annotation
    if not (
        isinstance(annotation, ast.Subscript)
        and isinstance(annotation.value, ast.Name)
        and annotation.value.id in {"A", "Annotated"}
    ):
        return set()
    meta = annotation.slice.elts[1:] if isinstance(annotation.slice, ast.Tuple) else []
    cli_name = "--" + statement.target.id.replace("_", "-")
    aliases: set[str] = set()
    for item in meta:
        if isinstance(item, ast.Call) and _called(item) == "Arg":
            for keyword in item.keywords:
                value = keyword.value
                if keyword.arg == "no_cli" and isinstance(value, ast.Constant) and value.value:
                    return set()
                if keyword.arg == "cli_name" and isinstance(value, ast.Constant):
                    cli_name = str(value.value)
                if keyword.arg == "aliases" and isinstance(value, ast.List | ast.Tuple):
                    aliases |= _strings(value.elts)
    if not meta:
        return set()
    return {cli_name} | aliases


def _called(node: ast.Call) -> str | None:
    if isinstance(node.func, ast.Attribute):
        return node.func.attr
    if isinstance(node.func, ast.Name):
        return node.func.id
    return None


def _strings(nodes: list[ast.expr]) -> set[str]:
    return {n.value for n in nodes if isinstance(n, ast.Constant) and isinstance(n.value, str)}


def emitted_flags(argv: list[str]) -> set[str]:
    return {arg for arg in argv if arg.startswith("--")}


def maximal_settings() -> Settings:
    """Every engine knob set, to make the builder emit every flag it knows."""
    return Settings(
        model="/models/Qwen3.6-27B",
        served_model_name="qwen36",
        tp_size=2,
        mem_fraction_static=0.85,
        max_running_requests=128,
        context_length=32768,
        reasoning_parser="qwen3",
        tool_call_parser="qwen3_coder",
        trust_remote_code=True,
        mamba_cache_strategy="extra_buffer",
        attention_backend="fa3",
        enable_metrics=True,
        engine_api_key="k",
        engine_log_level="warning",
        speculative_algorithm="EAGLE",
        speculative_num_steps=3,
        speculative_eagle_topk=1,
        speculative_num_draft_tokens=4,
    )


@pytest.mark.parametrize("version", VERSIONS)
@pytest.mark.parametrize(
    "case",
    ["mtp-qwen-hybrid", "no-mtp", "maximal", "maximal-deepseek"],
)
def test_every_emitted_flag_exists_in_that_release(version: str, case: str) -> None:
    if case == "mtp-qwen-hybrid":
        launch = sglang_launch(Settings(model="/m/q"), 30001, version, arch=QWEN35)
    elif case == "no-mtp":
        launch = sglang_launch(Settings(model="/m/q", mtp=False), 30001, version, arch=QWEN35)
    else:
        arch = QWEN35 if case == "maximal" else "DeepseekV3ForCausalLM"
        launch = sglang_launch(maximal_settings(), 30001, version, arch=arch)
    unknown = emitted_flags(launch.argv) - wheel_flags(version)
    assert not unknown, f"sglang {version} does not define {sorted(unknown)}"


def test_maximal_settings_emit_every_flag_the_builder_knows() -> None:
    argv = sglang_launch(maximal_settings(), 30001, NEWEST_SGLANG, arch=QWEN35).argv
    assert emitted_flags(argv) == {
        "--model-path",
        "--served-model-name",
        "--tp-size",
        "--host",
        "--port",
        "--mem-fraction-static",
        "--max-running-requests",
        "--stream-interval",
        "--incremental-streaming-output",
        "--context-length",
        "--reasoning-parser",
        "--tool-call-parser",
        "--trust-remote-code",
        "--speculative-algorithm",
        "--speculative-num-steps",
        "--speculative-eagle-topk",
        "--speculative-num-draft-tokens",
        "--mamba-radix-cache-strategy",
        "--attention-backend",
        "--enable-metrics",
        "--log-level",
    }  # fmt: skip  (the API key goes through --config: see below)


def test_extraction_finds_both_eras_flags() -> None:
    for version in VERSIONS:
        flags = wheel_flags(version)
        assert {"--model-path", "--tp-size", "--tensor-parallel-size", "--api-key"} <= flags
        assert len(flags) > 300


def test_the_mamba_flag_drift_is_caught() -> None:
    old, new = wheel_flags(OLDEST_SGLANG), wheel_flags(NEWEST_SGLANG)
    assert "--mamba-scheduler-strategy" in old
    assert "--mamba-radix-cache-strategy" not in old
    assert "--mamba-scheduler-strategy" not in new
    assert "--mamba-radix-cache-strategy" in new
    assert "--genfleet-no-such-flag" not in old | new


@pytest.mark.parametrize("version", VERSIONS)
def test_spec_v2_env_only_where_the_release_knows_it(version: str) -> None:
    launch = sglang_launch(Settings(model="/m/q"), 30001, version, arch=QWEN35)
    with zipfile.ZipFile(wheel(version)) as archive:
        environ = archive.read("sglang/srt/environ.py").decode()
    declared = "SGLANG_ENABLE_SPEC_V2 = EnvBool(" in environ
    assert ("SGLANG_ENABLE_SPEC_V2" in launch.env) == declared
    assert declared == (version == OLDEST_SGLANG)


@pytest.mark.parametrize("version", VERSIONS)
def test_the_chosen_entry_point_exists(version: str) -> None:
    program = sglang_launch(Settings(model="/m/q"), 30001, version, arch=QWEN35).argv[:2]
    with zipfile.ZipFile(wheel(version)) as archive:
        names = set(archive.namelist())
        entry_points = next(n for n in names if n.endswith(".dist-info/entry_points.txt"))
        scripts = archive.read(entry_points).decode()
        cli_main = archive.read("sglang/cli/main.py").decode()
    assert "sglang/launch_server.py" in names
    if program == ["sglang", "serve"]:
        assert "sglang = sglang.cli.main:main" in scripts
        assert '"serve"' in cli_main
    assert parse_release(version) >= (0, 5, 5)


def test_hybrid_archs_are_known_to_the_newest_release() -> None:
    with zipfile.ZipFile(wheel(NEWEST_SGLANG)) as archive:
        overrides = archive.read("sglang/srt/arg_groups/overrides.py").decode()
    for arch in HYBRID_ARCHS:
        assert f'"{arch}"' in overrides


@pytest.mark.parametrize("version", VERSIONS)
def test_the_release_reads_the_api_key_from_the_config_file_genfleet_writes(
    version: str, tmp_path: Path
) -> None:
    """The release's own `ConfigArgumentMerger`, run on the file the supervisor writes (a JSON
    object, which is YAML), gives `--api-key` to its parser: the key never needs argv."""
    import argparse

    launch = sglang_launch(maximal_settings(), 30001, version, arch=QWEN35)
    assert "--config" in wheel_flags(version) and "--api-key" not in launch.argv
    with zipfile.ZipFile(wheel(version)) as archive:
        name = next(n for n in archive.namelist() if n.endswith("server_args_config_parser.py"))
        source = archive.read(name).decode()
        server_args = archive.read("sglang/srt/server_args.py").decode()
    assert "config_merger.merge_config_with_args(argv)" in server_args
    namespace: dict[str, Any] = {"__name__": "sglang_config_parser"}
    exec(compile(source, name, "exec"), namespace)  # noqa: S102 - the release's own parser
    parser = argparse.ArgumentParser()
    parser.add_argument("--model-path")
    parser.add_argument("--api-key", default=None)
    parser.add_argument("--config")
    config = tmp_path / "engine.yaml"
    config.write_bytes(orjson.dumps(launch.config))
    argv = namespace["ConfigArgumentMerger"](parser).merge_config_with_args(
        ["--model-path", "/m", "--config", str(config)]
    )
    assert parser.parse_args(argv).api_key == "k"


def test_adaptive_runs_under_the_default_scheduler_only_from_0_5_12() -> None:
    """0.5.11 drops --speculative-adaptive when the overlap scheduler is on; 0.5.23 does not."""
    adaptive = Settings(model="/m/q", speculative_adaptive=True)
    argv = sglang_launch(adaptive, 30001, NEWEST_SGLANG, arch=QWEN35).argv
    assert "--speculative-adaptive" in argv
    assert not emitted_flags(argv) - wheel_flags(NEWEST_SGLANG)
    assert "--speculative-adaptive" in wheel_flags(OLDEST_SGLANG)  # the flag exists there...
    source = "sglang/srt/speculative/adaptive_spec_params.py"
    with zipfile.ZipFile(wheel(OLDEST_SGLANG)) as archive:
        old = archive.read(source).decode()
    with zipfile.ZipFile(wheel(NEWEST_SGLANG)) as archive:
        new = archive.read(source).decode()
    assert "the overlap scheduler (spec v2) is enabled" in old  # ...but falls back to static
    assert "overlap scheduler" not in new
