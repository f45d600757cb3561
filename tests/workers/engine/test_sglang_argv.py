"""Settings × SGLang version → the exact argv and environment the worker launches."""

from __future__ import annotations

import json
import sys
from importlib import metadata
from typing import Any

import pytest

from genfleet.common.errors import ConfigError
from genfleet.common.settings import Settings
from genfleet.workers.engine import sglang_argv
from genfleet.workers.engine.kinds import engine_launch, print_engine_command
from genfleet.workers.engine.launch import engine_env
from genfleet.workers.engine.sglang_argv import parse_release, resolve_sglang_version, sglang_launch

QWEN35 = "Qwen3_5ForConditionalGeneration"
MODEL = "/models/Qwen3.6-27B"
PORT = 30001

SERVE = ["sglang", "serve"]
HEAD = [
    "--model-path", MODEL, "--served-model-name", MODEL, "--tp-size", "1",
    "--host", "127.0.0.1", "--port", str(PORT), "--max-running-requests", "256",
    "--stream-interval", "8", "--incremental-streaming-output", "--reasoning-parser", "qwen3",
]  # fmt: skip
HEAD_NO_PARSER = HEAD[:-2]
MTP = [
    "--speculative-algorithm", "EAGLE", "--speculative-num-steps", "3",
    "--speculative-eagle-topk", "1", "--speculative-num-draft-tokens", "4",
]  # fmt: skip
TAIL = ["--enable-metrics", "--log-level", "info"]
NEW_MAMBA = ["--mamba-radix-cache-strategy", "extra_buffer"]
OLD_MAMBA = ["--mamba-scheduler-strategy", "extra_buffer"]
SPEC_V2 = {"SGLANG_ENABLE_SPEC_V2": "1"}


CASES: list[tuple[str, dict[str, Any], str, str | None, list[str], dict[str, str]]] = [
    # id, settings, version, arch, argv, env
    ("defaults@0.5.23", {}, "0.5.23", QWEN35, SERVE + HEAD + MTP + NEW_MAMBA + TAIL, {}),
    ("defaults@0.5.11", {}, "0.5.11", QWEN35, SERVE + HEAD + MTP + OLD_MAMBA + TAIL, SPEC_V2),
    (
        "next@0.5.13.post1",
        {},
        "0.5.13.post1",
        "Qwen3NextForCausalLM",
        SERVE + HEAD + MTP + OLD_MAMBA + TAIL,
        SPEC_V2,
    ),
    (
        "moe@0.5.14",
        {},
        "0.5.14",
        "Qwen3_5MoeForConditionalGeneration",
        SERVE + HEAD + MTP + NEW_MAMBA + TAIL,
        {},
    ),
    ("no-mtp@0.5.11", {"mtp": False}, "0.5.11", QWEN35, SERVE + HEAD + TAIL, {}),
    ("no-mtp@0.5.23", {"mtp": False}, "0.5.23", QWEN35, SERVE + HEAD + TAIL, {}),
    (
        "explicit-mamba-no-mtp@0.5.23",
        {"mtp": False, "mamba_cache_strategy": "no_buffer"},
        "0.5.23",
        QWEN35,
        SERVE + HEAD + ["--mamba-radix-cache-strategy", "no_buffer"] + TAIL,
        {},
    ),
    (
        "explicit-mamba@0.5.11",
        {"mamba_cache_strategy": "no_buffer"},
        "0.5.11",
        "LlamaForCausalLM",
        SERVE + HEAD_NO_PARSER + MTP + ["--mamba-scheduler-strategy", "no_buffer"] + TAIL,
        {},
    ),
    (
        "spec-knobs",
        {
            "speculative_algorithm": "NEXTN",
            "speculative_num_steps": 5,
            "speculative_eagle_topk": 4,
            "speculative_num_draft_tokens": 8,
        },
        "0.5.23",
        QWEN35,
        SERVE
        + HEAD
        + [
            "--speculative-algorithm",
            "NEXTN",
            "--speculative-num-steps",
            "5",
            "--speculative-eagle-topk",
            "4",
            "--speculative-num-draft-tokens",
            "8",
        ]  # fmt: skip
        + NEW_MAMBA
        + TAIL,
        {},
    ),
    (
        "deepseek@0.5.11",
        {},
        "0.5.11",
        "DeepseekV3ForCausalLM",
        SERVE + HEAD_NO_PARSER + ["--reasoning-parser", "deepseek-v3"] + MTP + TAIL,
        {},
    ),
    # a hub id: the name picks the parser, nothing else (SGLang's own `auto` mamba choice)
    ("unknown-arch@0.5.23", {}, "0.5.23", None, SERVE + HEAD + MTP + TAIL, {}),
    (
        "given-arch@0.5.11",
        {"model_architecture": QWEN35},
        "0.5.11",
        None,
        SERVE + HEAD + MTP + OLD_MAMBA + TAIL,
        SPEC_V2,
    ),
    ("unknown-arch-no-mtp@0.5.11", {"mtp": False}, "0.5.11", None, SERVE + HEAD + TAIL, {}),
    (
        "every-knob",
        {
            "served_model_name": "qwen36",
            "tp_size": 4,
            "mem_fraction_static": 0.85,
            "max_running_requests": 512,
            "context_length": 65536,
            "reasoning_parser": "none",
            "tool_call_parser": "qwen3_coder",
            "trust_remote_code": True,
            "attention_backend": "fa3",
            "enable_metrics": False,
            "engine_log_level": "warning",
        },
        "0.5.23",
        QWEN35,
        SERVE
        + [
            "--model-path",
            MODEL,
            "--served-model-name",
            "qwen36",
            "--tp-size",
            "4",
            "--host",
            "127.0.0.1",
            "--port",
            str(PORT),
            "--mem-fraction-static",
            "0.85",
            "--max-running-requests",
            "512",
            "--stream-interval",
            "8",
            "--incremental-streaming-output",
            "--context-length",
            "65536",
            "--tool-call-parser",
            "qwen3_coder",
            "--trust-remote-code",
        ]  # fmt: skip
        + MTP
        + NEW_MAMBA
        + ["--attention-backend", "fa3", "--log-level", "warning"],
        {},
    ),
    (
        "extra-args-last",
        {"engine_extra_args": "--page-size 64 --json-model-override-args '{\"a\": 1}'"},
        "0.5.23",
        QWEN35,
        SERVE
        + HEAD
        + MTP
        + NEW_MAMBA
        + TAIL
        + ["--page-size", "64", "--json-model-override-args", '{"a": 1}'],
        {},
    ),
    (
        "api-key",
        {"engine_api_key": "s3cret"},
        "0.5.23",
        QWEN35,
        SERVE + HEAD + MTP + NEW_MAMBA + TAIL,  # the key is not on argv: see below
        {},
    ),
    (
        "before-sglang-serve@0.5.4",
        {"mtp": False},
        "0.5.4",
        QWEN35,
        [sys.executable, "-m", "sglang.launch_server"] + HEAD + TAIL,
        {},
    ),
]


@pytest.mark.parametrize(
    ("settings_kw", "version", "arch", "argv", "env"),
    [pytest.param(*case[1:], id=case[0]) for case in CASES],
)
def test_argv_table(
    settings_kw: dict[str, Any],
    version: str,
    arch: str | None,
    argv: list[str],
    env: dict[str, str],
) -> None:
    launch = sglang_launch(Settings(model=MODEL, **settings_kw), PORT, version, arch=arch)
    assert launch.argv == argv
    assert launch.env == env
    assert (launch.kind, launch.host, launch.port, launch.health_path) == (
        "sglang",
        "127.0.0.1",
        PORT,
        "/health",
    )


def test_api_key_goes_through_the_config_file_not_argv() -> None:
    launch = sglang_launch(Settings(model=MODEL, engine_api_key="s3cret"), PORT, "0.5.23")
    assert launch.api_key == "s3cret"
    assert launch.config == {"api-key": "s3cret"}  # SGLang's `--config` YAML (JSON is YAML)
    assert not any("s3cret" in arg for arg in launch.argv) and "--api-key" not in launch.argv
    text = launch.describe()
    assert "s3cret" not in text
    assert "--config <0600 file: api-key=***>" in text


def test_engine_env_keeps_what_engines_read_and_drops_secrets() -> None:
    inherited = {
        "PATH": "/usr/bin",
        "HOME": "/home/u",
        "LD_LIBRARY_PATH": "/usr/local/cuda/lib64",
        "CUDA_HOME": "/usr/local/cuda",
        "HF_HOME": "/models/hf",
        "NCCL_DEBUG": "WARN",
        "SGLANG_ENABLE_SPEC_V2": "1",
        "GENFLEET_REDIS_URL": "redis://:pw@redis:6379/0",
        "GENFLEET_ENGINE_API_KEY": "k",
        "AWS_ACCESS_KEY_ID": "AKIA",
        "AWS_SECRET_ACCESS_KEY": "secret",
        "FLOWER_BASIC_AUTH": "u:p",
        "REDIS_PASSWORD": "pw",
        "S3_SECRET_ACCESS_KEY": "secret",
    }
    env = engine_env(inherited, {"GENFLEET_EMULATOR_TIME_SCALE": "20"}, "2,3")
    assert env == {
        "PATH": "/usr/bin",
        "HOME": "/home/u",
        "LD_LIBRARY_PATH": "/usr/local/cuda/lib64",
        "CUDA_HOME": "/usr/local/cuda",
        "HF_HOME": "/models/hf",
        "NCCL_DEBUG": "WARN",
        "SGLANG_ENABLE_SPEC_V2": "1",
        "GENFLEET_EMULATOR_TIME_SCALE": "20",
        "CUDA_VISIBLE_DEVICES": "2,3",
        "PYTHONUNBUFFERED": "1",
    }


def test_describe_shows_the_environment_first() -> None:
    launch = sglang_launch(Settings(model=MODEL), PORT, "0.5.11", arch=QWEN35)
    assert launch.describe().startswith("SGLANG_ENABLE_SPEC_V2=1 sglang serve --model-path ")


def test_explicit_program_replaces_the_entry_point() -> None:
    launch = sglang_launch(Settings(model=MODEL), PORT, "0.5.23", ["python", "-m", "x"])
    assert launch.argv[:4] == ["python", "-m", "x", "--model-path"]


def test_version_comes_from_settings_then_installed_then_newest(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    def not_installed(name: str) -> str:
        raise metadata.PackageNotFoundError(name)

    monkeypatch.setattr(sglang_argv.metadata, "version", not_installed)
    assert resolve_sglang_version(Settings()) == "0.5.23"
    assert resolve_sglang_version(Settings(sglang_version="0.5.11")) == "0.5.11"
    assert resolve_sglang_version(Settings(sglang_version="0.5.11"), "0.5.15") == "0.5.15"
    monkeypatch.setattr(sglang_argv.metadata, "version", lambda name: "0.5.12")
    assert resolve_sglang_version(Settings()) == "0.5.12"
    launch = sglang_launch(Settings(model=MODEL), PORT, arch=QWEN35)
    assert "--mamba-scheduler-strategy" in launch.argv


@pytest.mark.parametrize(
    ("text", "release"),
    [("0.5.23", (0, 5, 23)), ("0.5.13.post1", (0, 5, 13)), ("v0.6", (0, 6, 0)), ("1", (1, 0, 0))],
)
def test_parse_release(text: str, release: tuple[int, ...]) -> None:
    assert parse_release(text) == release


def test_bad_version_and_served_name_are_config_errors() -> None:
    with pytest.raises(ConfigError, match="not an SGLang version"):
        sglang_launch(Settings(model=MODEL), PORT, "latest")
    with pytest.raises(ConfigError, match="--served-model-name"):
        sglang_launch(Settings(model="/m/qwen:27b"), PORT, "0.5.23")


def test_emulator_runs_the_same_argv_with_its_knobs(monkeypatch: pytest.MonkeyPatch) -> None:
    settings = Settings(engine="emulator", emulator_time_scale=10.0)
    launch = engine_launch(settings, PORT, arch=QWEN35)
    assert launch is not None
    sglang = sglang_launch(Settings(model="genfleet/emulated"), PORT, "0.5.23", arch=QWEN35)
    assert launch.kind == "emulator"
    assert launch.argv[:3] == [sys.executable, "-m", "genfleet.workers.engine.emulator"]
    assert launch.argv[3:] == sglang.argv[2:]
    assert launch.env["GENFLEET_EMULATOR_TIME_SCALE"] == "10.0"
    assert all(name.startswith("GENFLEET_EMULATOR_") for name in launch.env)


def test_emulator_keeps_a_given_model_name() -> None:
    launch = engine_launch(Settings(engine="emulator", model="org/name"), PORT)
    assert launch is not None
    assert launch.argv[3:5] == ["--model-path", "org/name"]


def test_sglang_kind_dispatches_to_the_builder() -> None:
    settings = Settings(model=MODEL, sglang_version="0.5.23")
    launch = engine_launch(settings, PORT, arch=QWEN35)
    assert launch == sglang_launch(settings, PORT, arch=QWEN35)


def test_command_launcher_fills_placeholders_per_word() -> None:
    settings = Settings(
        engine="command",
        model="/models/my model",
        engine_command="vllm serve {model} --host {host} --port={port} --x '{{literal}}'",
        engine_health_path="/v1/models",
        engine_api_key="k",
    )
    launch = engine_launch(settings, PORT)
    assert launch is not None
    assert launch.argv == [
        "vllm", "serve", "/models/my model", "--host", "127.0.0.1", f"--port={PORT}",
        "--x", "{literal}",
    ]  # fmt: skip
    assert (launch.kind, launch.port, launch.health_path) == ("command", PORT, "/v1/models")
    assert launch.api_key == "k"
    # The key in the environment (vLLM reads VLLM_API_KEY), never on argv, masked in print.
    assert launch.env == {"GENFLEET_ENGINE_API_KEY": "k", "VLLM_API_KEY": "k"}
    assert "k" not in launch.argv and "=k" not in launch.describe()
    assert "VLLM_API_KEY=***" in launch.describe()


@pytest.mark.parametrize(
    ("command", "model", "message"),
    [
        ("vllm serve {model}", "/m", r"no \{port\} placeholder"),
        ("serve --port {port} --gpu {gpu}", "/m", "unknown placeholder.*gpu"),
        ("serve {model} --port {port}", None, r"uses \{model\} but no --model"),
        ("serve --port {port", "/m", "--engine-command word"),
    ],
)
def test_command_launcher_errors(command: str, model: str | None, message: str) -> None:
    settings = Settings(engine="command", engine_command=command, model=model)
    with pytest.raises(ConfigError, match=message):
        engine_launch(settings, PORT)


def test_external_engine_launches_nothing() -> None:
    settings = Settings(engine="external", engine_url="http://gpu-box:30000")
    assert engine_launch(settings, PORT) is None
    assert "launches nothing" in print_engine_command(settings)


def test_print_engine_command_is_the_describe_text() -> None:
    settings = Settings(model=MODEL, sglang_version="0.5.23", engine_api_key="s3cret")
    text = print_engine_command(settings, port=PORT)
    launch = sglang_launch(settings, PORT)
    command, family, plan = text.split("\n")
    assert command == launch.describe()
    assert plan == "# engine plan: no config.json to plan from: today's argv"
    assert family.startswith("# model family qwen3.5 (architecture unknown, from name)")
    assert "reasoning parser qwen3" in family and "enable_thinking" in family
    assert "s3cret" not in text
    assert print_engine_command(settings).count("--port 30000") == 1


ADAPTIVE = [
    "--speculative-algorithm", "EAGLE", "--speculative-adaptive", "--speculative-num-steps", "3",
    "--speculative-eagle-topk", "1", "--speculative-num-draft-tokens", "4",
]  # fmt: skip


@pytest.mark.parametrize(
    ("version", "supported"),
    [("0.5.11", False), ("0.5.12", True), ("0.5.13.post1", True), ("0.5.23", True)],
)
def test_adaptive_flag_from_0_5_12(version: str, supported: bool) -> None:
    settings = Settings(model=MODEL, speculative_adaptive=True)
    if not supported:
        with pytest.raises(ConfigError, match=r"SGLang 0\.5\.12 or later; 0\.5\.11"):
            sglang_launch(settings, PORT, version, arch=QWEN35)
        return
    argv = sglang_launch(settings, PORT, version, arch=QWEN35).argv
    assert argv[argv.index("--speculative-algorithm") :][: len(ADAPTIVE)] == ADAPTIVE
    off = sglang_launch(settings.model_copy(update={"mtp": False}), PORT, version, arch=QWEN35)
    assert "--speculative-adaptive" not in off.argv  # adaptive is a kind of MTP, not a switch


@pytest.mark.parametrize(
    ("update", "says"),
    [
        ({"speculative_algorithm": "STANDALONE"}, "EAGLE, EAGLE3 or NEXTN only"),
        ({"speculative_eagle_topk": 4}, "topk 1"),
        ({"speculative_num_steps": 5}, "num-steps 1/3/7"),
    ],
)
def test_adaptive_refuses_what_sglang_would_run_static(update: dict[str, Any], says: str) -> None:
    settings = Settings(model=MODEL, speculative_adaptive=True, **update)
    with pytest.raises(ConfigError, match=says):
        sglang_launch(settings, PORT, "0.5.23", arch=QWEN35)


@pytest.mark.parametrize(
    ("update", "arch", "added"),
    [
        # SGLang 0.5.15 dies under genfleet's load here (bench/real_sglang/README.md).
        ({"attention_backend": "triton"}, QWEN35, ["--disable-cuda-graph"]),
        ({"attention_backend": "triton", "mtp": False}, QWEN35, []),
        ({"attention_backend": "triton"}, "Qwen3ForCausalLM", []),
        ({"attention_backend": "fa3"}, QWEN35, []),
        ({}, QWEN35, []),
        # the user decided CUDA graphs: nothing added, nothing doubled
        (
            {"attention_backend": "triton", "engine_extra_args": "--cuda-graph-max-bs 128"},
            QWEN35,
            [],
        ),
        (
            {"attention_backend": "triton", "engine_extra_args": "--disable-cuda-graph"},
            QWEN35,
            [],
        ),
    ],
)
def test_known_crash_is_avoided_by_default(
    update: dict[str, Any], arch: str, added: list[str]
) -> None:
    settings = Settings(model=MODEL, **update)
    argv = sglang_launch(settings, PORT, "0.5.15", arch=arch).argv
    extra = settings.engine_extra_args.split()
    assert argv.count("--disable-cuda-graph") == added.count("--disable-cuda-graph") + (
        extra.count("--disable-cuda-graph")
    )
    note = sglang_argv.crash_workaround(settings, arch)[1]
    assert (note is not None) == bool(added)


def test_print_engine_command_says_why_it_disables_cuda_graphs(tmp_path: Any) -> None:
    (tmp_path / "config.json").write_text(json.dumps({"architectures": [QWEN35]}))
    settings = Settings(model=str(tmp_path), attention_backend="triton", sglang_version="0.5.15")
    text = print_engine_command(settings, PORT)
    first, *comments = text.splitlines()
    assert "--disable-cuda-graph" in first.split()
    assert any(c.startswith("# avoids a known SGLang crash") for c in comments)
    plain = print_engine_command(settings.model_copy(update={"mtp": False}), PORT)
    assert "--disable-cuda-graph" not in plain and "avoids" not in plain


@pytest.mark.parametrize(
    ("argv", "extra", "added"),
    [
        (["--max-running-requests", "320"], [], ["--cuda-graph-max-bs", "320"]),
        (["--max-running-requests=300"], [], ["--cuda-graph-max-bs", "300"]),
        (["--max-running-requests", "256"], [], []),  # within SGLang's own graphs
        (["--max-running-requests", "98"], [], []),
        ([], [], []),
        # the last value is SGLang's
        (["--max-running-requests", "320"], ["--max-running-requests", "128"], []),
        (
            ["--max-running-requests", "98"],
            ["--max-running-requests=400"],
            ["--cuda-graph-max-bs", "400"],
        ),
        # CUDA graphs already decided: off (the crash workaround), or sized by the user
        (["--max-running-requests", "320", "--disable-cuda-graph"], [], []),
        (["--max-running-requests", "320"], ["--cuda-graph-max-bs", "160"], []),
        (["--max-running-requests", "320"], ["--cuda-graph-bs=8,16"], []),
        (["--max-running-requests"], [], []),  # no value: SGLang refuses it, nothing added
    ],
)
def test_a_batch_above_sglang_s_graphs_gets_graphs_its_size(
    argv: list[str], extra: list[str], added: list[str]
) -> None:
    assert sglang_argv.graph_args(argv, extra) == added


@pytest.mark.parametrize(
    ("cap", "tp_size", "added"), [(512, 4, False), (600, 4, True), (300, 2, True)]
)
def test_from_four_gpus_sglang_captures_graphs_up_to_512(
    cap: int, tp_size: int, added: bool
) -> None:
    argv = ["--max-running-requests", str(cap)]
    assert bool(sglang_argv.graph_args(argv, [], tp_size)) == added


def test_a_cap_above_256_runs_in_cuda_graphs_and_says_why(tmp_path: Any) -> None:
    """A pinned cap of 320 on a dense model: SGLang would run a full batch eagerly."""
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["Qwen3ForCausalLM"]}))
    settings = Settings(model=str(tmp_path), max_running_requests=320, sglang_version="0.5.15")
    first, *comments = print_engine_command(settings, PORT).splitlines()
    words = first.split()
    assert words[words.index("--cuda-graph-max-bs") + 1] == "320"
    assert any(c.startswith("# --cuda-graph-max-bs 320: a full batch") for c in comments)
    mtp_triton = settings.model_copy(update={"attention_backend": "triton"})
    (tmp_path / "config.json").write_text(json.dumps({"architectures": [QWEN35]}))
    words = print_engine_command(mtp_triton, PORT).splitlines()[0].split()
    assert "--disable-cuda-graph" in words and "--cuda-graph-max-bs" not in words


def test_a_port_sglang_cannot_start_on_is_refused_before_the_launch() -> None:
    """SGLang exits at start where --port + 10000 (its gRPC port) passes 65535: refused here,
    naming the flag; the emulator, which has no such port, takes any."""
    settings = Settings(model=MODEL, mtp=False)
    assert "55535" in sglang_launch(settings, 55535, "0.5.15", arch=QWEN35).argv
    with pytest.raises(ConfigError, match=r"port 55536 .*GENFLEET_PORT"):
        sglang_launch(settings, 55536, "0.5.15", arch=QWEN35)
    emulated = sglang_launch(settings, 60000, "0.5.15", program=["emulator"], arch=QWEN35)
    assert "60000" in emulated.argv
