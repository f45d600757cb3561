"""Every setting as a flag: the options generated from the settings model, their groups in
`--help`, the parse of each GPU-side command and `run`, and the one error exit."""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import typer
from typer.testing import CliRunner

from genfleet.cli import app as root
from genfleet.common.flags import (
    EMULATOR,
    ENGINE,
    FEEDING,
    FIELDS,
    GENERATION,
    MTP,
    PANELS,
    STORE,
    WATCH,
    with_settings,
)
from genfleet.common.settings import Settings

ROOT = Path(__file__).resolve().parents[2]
WIDE = {"COLUMNS": "400"}  # rich cuts long option names to fit 80 columns


def probe_app() -> tuple[typer.Typer, list[Settings]]:
    """A one-command app whose command records the Settings it receives."""
    seen: list[Settings] = []
    app = typer.Typer()

    @with_settings(exclude={"role"})
    def probe(settings: Settings, label: str = "x") -> None:
        seen.append(settings)

    app.command()(probe)
    app.command("other")(lambda: None)  # two commands: `probe` stays a subcommand
    return app, seen


def options_of(app: typer.Typer, command: str) -> dict[str, Any]:
    group: Any = typer.main.get_command(app)
    with group.make_context("t", [command]) as ctx:
        found = group.get_command(ctx, command)
        return {p.name: p for p in found.params}


def parse(app: typer.Typer, args: list[str]) -> dict[str, Any]:
    """What the probe command's parser makes of `args` (nothing runs)."""
    group: Any = typer.main.get_command(app)
    with group.make_context("t", ["probe"]) as ctx:
        found = group.get_command(ctx, "probe")
        with found.make_context("probe", args, parent=ctx) as sub:
            return dict(sub.params)


# name, the flags, what the parser makes of them, flags the type refuses, default shown, panel
TYPES = [
    ("batch_size", ["--batch-size", "3"], 3, ["--batch-size", "x"], "256", GENERATION),
    ("max_inflight", ["--max-inflight", "8"], 8, ["--max-inflight", "8.5"], False, FEEDING),
    ("temperature", ["--temperature", "0.25"], 0.25, ["--temperature", "hot"], "0.6", GENERATION),
    ("mem_fraction_static", ["--mem-fraction-static", ".8"], 0.8, None, False, ENGINE),
    ("model", ["--model", "/m"], "/m", None, False, ENGINE),
    ("store", ["--store", "/s"], "/s", None, "~/.local/share/genfleet/store", STORE),
    (
        "redis_url",
        ["--redis-url", "redis://h:1/0"],
        "redis://h:1/0",
        None,
        "redis://127.0.0.1:6379/0",
        STORE,
    ),
    ("engine_api_key", ["--engine-api-key", "k"], "k", None, False, ENGINE),
    ("mtp", ["--no-mtp"], False, ["--mtp=yes"], "true", MTP),
    ("trust_remote_code", ["--trust-remote-code"], True, None, "false", ENGINE),
    ("engine", ["--engine", "external"], "external", ["--engine", "vllm"], False, ENGINE),
    ("power_window_s", ["--power-window-s", "5"], 5.0, None, "60.0", WATCH),
    (
        "emulator_fail_after_requests",
        ["--emulator-fail-after-requests", "2"],
        2,
        None,
        False,
        EMULATOR,
    ),
]


@pytest.mark.parametrize(("name", "args", "value", "refused", "shown", "panel"), TYPES)
def test_a_field_of_each_type_becomes_its_option(
    name: str, args: list[str], value: Any, refused: list[str] | None, shown: Any, panel: str
) -> None:
    app, _ = probe_app()
    option = options_of(app, "probe")[name]
    assert option.opts == ["--" + name.replace("_", "-")]
    if isinstance(value, bool):
        assert option.secondary_opts == ["--no-" + name.replace("_", "-")]
    assert option.default is None  # not given: the environment or the file decides
    assert option.show_default == shown
    assert option.rich_help_panel == panel
    assert f"GENFLEET_{name.upper()}" in option.help and FIELDS[name][1] in option.help
    parsed = parse(app, args)[name]
    assert getattr(parsed, "value", parsed) == value and type(value) is type(
        getattr(parsed, "value", parsed)
    )
    assert parse(app, [])[name] is None
    if refused is not None:
        result = CliRunner().invoke(app, ["probe", *refused])
        assert result.exit_code == 2 and refused[0].split("=")[0] in result.output


def test_every_setting_has_help_and_a_panel() -> None:
    assert set(FIELDS) == set(Settings.model_fields)
    assert {panel for panel, _ in FIELDS.values()} <= set(PANELS)
    assert all(text for _, text in FIELDS.values())


def test_excluded_settings_are_no_options_and_own_options_stay() -> None:
    app, _ = probe_app()
    options = options_of(app, "probe")
    assert "role" not in options and "label" in options and "settings_file" in options
    assert set(options) == {*Settings.model_fields, "settings_file", "label"} - {"role"}


def test_a_command_may_not_shadow_a_setting() -> None:
    def clash(settings: Settings, mtp: str = "on") -> None: ...

    with pytest.raises(TypeError, match="mtp"):
        with_settings()(clash)


def test_flags_over_file_over_environment(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("GENFLEET_MAX_INFLIGHT", "17")
    monkeypatch.setenv("GENFLEET_BATCH_SIZE", "9")
    monkeypatch.setenv("GENFLEET_TEMPERATURE", "0.1")
    tuned = tmp_path / "tuned.env"
    tuned.write_text("GENFLEET_MTP=false\nGENFLEET_MAX_INFLIGHT=64\nGENFLEET_BATCH_SIZE=32\n")
    app, seen = probe_app()
    args = ["probe", "--settings-file", str(tuned), "--batch-size", "5", "--engine", "emulator"]
    result = CliRunner().invoke(app, [*args, "--temperature", "0.25", "--trust-remote-code"])
    assert result.exit_code == 0, result.output
    [settings] = seen
    assert settings.batch_size == 5  # flag over file over environment
    assert settings.max_inflight == 64 and settings.mtp is False  # file over environment
    assert settings.temperature == 0.25 and settings.trust_remote_code is True
    assert settings.engine == "emulator"  # a choice arrives as its plain value
    assert settings.top_p == 0.95  # nothing given anywhere: the model's default


def run_cli(args: list[str]) -> tuple[int, str]:
    result = CliRunner().invoke(root, args, env=WIDE)
    return result.exit_code, result.output


@pytest.mark.parametrize(
    "command", ["worker", "control", "preflight", "top", "tune", "flower", "run", "enqueue"]
)
def test_an_unknown_flag_fails_naming_it(command: str) -> None:
    source = ["data.jsonl"] if command in {"run", "enqueue"} else []
    args = [command, "--no-such-knob", "3", *source]
    code, output = run_cli(args)
    assert code == 2
    assert "No such option: --no-such-knob" in output


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (
            ["worker", "--batch-size", "0"],
            "--batch-size (GENFLEET_BATCH_SIZE): Input should be greater than or equal to 1",
        ),
        (
            ["run", "x.jsonl", "--top-p", "2"],
            "--top-p (GENFLEET_TOP_P): Input should be less than or equal to 1",
        ),
        (["tune", "--engine", "sglang"], "--engine sglang needs --model"),
        (["worker", "--settings-file", "/no/such.env"], "--settings-file /no/such.env"),
        (["worker", "--gpus", "0,1,2", "--tp-size", "2"], "not a multiple of --tp-size 2"),
        (["tune", "--pick", "speed"], "--pick takes throughput or energy"),
        (
            ["enqueue", "x.jsonl", "--run", "x", "--top-p", "2"],
            "--top-p (GENFLEET_TOP_P): Input should be less than or equal to 1",
        ),
    ],
)
def test_bad_settings_fail_through_the_one_error_exit(args: list[str], message: str) -> None:
    code, output = run_cli(args)
    assert code == 2
    assert output.startswith("error: ") and message in output


def panels_in_help(text: str) -> dict[str, set[str]]:
    """`--help` output → panel title → the flags listed in it."""
    found: dict[str, set[str]] = {}
    panel = ""
    for line in text.splitlines():
        title = re.match(r"\s*╭─ (.+?) ─", line)
        if title:
            panel = title.group(1)
            found[panel] = set()
        elif panel and line.count("│") >= 2:
            found[panel].update(re.findall(r"(?<![\w-])--[a-z0-9][a-z0-9-]*", line.split("│")[1]))
    return found


@pytest.mark.parametrize(
    ("command", "excluded"),
    [("worker", {"role"}), ("run", {"role"}), ("tune", {"mtp"}), ("enqueue", {"role"})],
)
def test_help_lists_every_setting_in_its_panel(command: str, excluded: set[str]) -> None:
    code, output = run_cli([command, "--help"])
    assert code == 0
    listed = panels_in_help(output)
    setting_panels = [p for p in listed if p in PANELS]
    assert setting_panels == [p for p in PANELS if p in setting_panels]  # in panel order
    for name, (panel, _) in FIELDS.items():
        flag = "--" + name.replace("_", "-")
        if name in excluded:
            assert all(flag not in flags for p, flags in listed.items() if p in PANELS), flag
        else:
            assert flag in listed[panel], f"{flag} not under {panel!r}"
    assert "--settings-file" in listed[STORE]


def test_the_gpu_side_parses_alone_with_the_same_options() -> None:
    """`python -m genfleet.workers` (what compose and the worker groups run) shows the same."""
    done = subprocess.run(
        [sys.executable, "-m", "genfleet.workers", "worker", "--help"],
        capture_output=True,
        text=True,
        timeout=60,
        env={"COLUMNS": "400", "PATH": "/usr/bin:/bin", "PYTHONPATH": str(ROOT)},
        check=False,
    )
    assert done.returncode == 0, done.stderr
    listed = panels_in_help(done.stdout)
    assert "--max-inflight" in listed[FEEDING] and "--print-engine-command" in listed["Options"]
    unknown = subprocess.run(
        [sys.executable, "-m", "genfleet.workers", "control", "--bogus"],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert unknown.returncode == 2 and "--bogus" in unknown.stderr


def test_settings_states_the_default_store(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("GENFLEET_STORE", raising=False)
    home = Path.home()
    code, output = run_cli(["settings", "--batch-size", "7"])
    assert code == 0
    default = (home / ".local/share/genfleet/store").as_uri()
    assert f"store: {default} (default: ~/.local/share/genfleet/store = {default})" in output
    assert re.search(r"--batch-size\s+GENFLEET_BATCH_SIZE\s+7\b", output)
    code, output = run_cli(["settings", "--store", "s3://b/p"])
    assert "store: s3://b/p (default: ~/.local/share/genfleet/store" in output


SOURCES = [
    p for package in ("common", "producer", "workers") for p in (ROOT / package).rglob("*.py")
]
# Processes whose edge is their environment: the emulator (spawned with its knobs there) and a
# Celery app started by the `celery` program itself (Flower, `celery inspect`).
ENVIRONMENT_EDGES = {"workers/engine/emulator/__main__.py", "workers/app.py"}


def test_no_module_smuggles_settings_through_its_own_environment() -> None:
    """Settings reach a child through `env=` at spawn, never through `os.environ` of this
    process; `Settings()` from the environment is built only at a process's edge."""
    for path in SOURCES:
        where = str(path.relative_to(ROOT))
        for node in ast.walk(ast.parse(path.read_text(), where)):
            text = ast.unparse(node)
            if isinstance(node, ast.Call) and text.startswith("os.environ."):
                method = text.removeprefix("os.environ.").split("(")[0]
                assert method in {"get", "items", "copy"}, f"{where}: {text}"
            if isinstance(node, (ast.Assign, ast.AugAssign, ast.Delete)):
                targets = (
                    node.targets if isinstance(node, (ast.Assign, ast.Delete)) else [node.target]
                )
                for target in targets:
                    assert not ast.unparse(target).startswith("os.environ"), f"{where}: {text}"
            if isinstance(node, ast.Call) and text == "Settings()":
                assert where in ENVIRONMENT_EDGES, f"{where}: Settings() outside an edge"
