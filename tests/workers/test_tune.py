"""`genfleet tune`: the pure helpers by table, and the emulator sweep end to end.

The sweep runs the real `python -m genfleet.workers tune` against the emulator started by the real
supervisor, and checks the trade-off the emulator models on SGLang's numbers: MTP wins at
one request in flight, and MTP with SGLang's silent speculative cap of 48 loses once the
client keeps far more than 48 requests open.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, cast

import pytest

from genfleet.common.errors import GenfleetError
from genfleet.common.records import GenerationParams, PromptRecord
from genfleet.common.settings import Settings
from genfleet.workers.cli import parse_tune_args as parse_args
from genfleet.workers.engine.sglang_argv import sglang_launch
from genfleet.workers.feeding import EngineClient
from genfleet.workers.observe.telemetry import GpuSample, Sampler
from genfleet.workers.tune import command as tune_command
from genfleet.workers.tune.command import point_settings, start_engine, stop_if_interrupted
from genfleet.workers.tune.measure import EngineReader, Live, Load, measure, window_tokens
from genfleet.workers.tune.sweep import (
    AUTO_CONCURRENCY,
    Point,
    TuneConfig,
    answer_tokens_in_window,
    best,
    markdown_table,
    parse_concurrency,
    parse_configs,
    settings_file_text,
    table_rows,
    tokens_in_window,
    verdict_text,
)
from harness.env import ROOT, engine_port_base
from tests.support.model_configs import qwen35_27b


def point(config: str, c: int, tps: float, power: float | None = 350.0, **kw: object) -> Point:
    values: dict[str, object] = {
        "config": config,
        "concurrency": c,
        "duration_s": 10.0,
        "requests": 100,
        "errors": 0,
        "tokens": tps * 10,
        "tokens_per_s": tps,
        "power_w": power,
        "power_limit_w": 700.0,
        "j_per_token": power / tps if power is not None and tps else None,
        "accept_length": None,
        "verdict": "ok",
        **kw,
    }
    return Point(**values)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("1,4,16", [1, 4, 16]),
        (" 8 , 8,2 ", [8, 2]),
        ("128", [128]),
    ],
)
def test_parse_concurrency(text: str, expected: list[int]) -> None:
    assert parse_concurrency(text) == expected


@pytest.mark.parametrize("text", ["", "0", "1,-4", "x"])
def test_parse_concurrency_refuses(text: str) -> None:
    with pytest.raises(ValueError, match="--concurrency"):
        parse_concurrency(text)


@pytest.mark.parametrize(
    ("text", "labels"),
    [
        ("on,off", ["on", "off"]),
        ("on,on:48,off", ["on", "on:48", "off"]),
        ("OFF:128, on", ["off:128", "on"]),
        ("on,on", ["on"]),
        ("on,Adaptive,adaptive:64,off", ["on", "adaptive", "adaptive:64", "off"]),
        (
            "off:plan*0.75,off:PLAN,off:plan*1.25,on:plan",
            ["off:plan*0.75", "off:plan", "off:plan*1.25", "on:plan"],
        ),
        ("off:plan*1", ["off:plan"]),
        ("off:radix,OFF:radix/4,on:radix/2.5", ["off:radix", "off:radix/4", "on:radix/2.5"]),
    ],
)
def test_parse_configs(text: str, labels: list[str]) -> None:
    assert [c.label for c in parse_configs(text)] == labels


@pytest.mark.parametrize(
    "text",
    [
        "",
        "maybe",
        "on:0",
        "on:x",
        "off:plan*0",
        "off:plan*x",
        "off:plan*99",
        "off:plans",
        "off:radix/0",
        "off:radix/x",
        "off:radixes",
    ],  # fmt: skip
)
def test_parse_configs_refuses(text: str) -> None:
    with pytest.raises(ValueError, match="--mtp"):
        parse_configs(text)


def test_config_cap() -> None:
    assert parse_configs("on:48")[0] == TuneConfig(mtp=True, max_running_requests=48)
    assert parse_configs("adaptive")[0] == TuneConfig(mtp=True, adaptive=True)
    planned = parse_configs("off:plan*1.25")[0]
    assert planned == TuneConfig(mtp=False, plan_scale=1.25)
    assert planned.planned_cap(94) == 118 and TuneConfig(False, plan_scale=0.01).planned_cap(5) == 1


def test_the_default_sweep_of_sglang_is_the_engine_plan() -> None:
    options, _ = parse_args(["--engine", "sglang", "--model", "/m"])
    assert [c.label for c in options.configs] == [
        "off:plan*0.75",
        "off:plan",
        "off:plan*1.25",
        "on:plan",
    ]
    assert options.concurrency == [AUTO_CONCURRENCY]
    options, _ = parse_args(["--engine", "sglang", "--model", "/m", "--no-engine-plan"])
    assert [c.label for c in options.configs] == ["on", "on:48", "off"]
    assert options.concurrency == [1, 4, 16, 64, 128]
    options, _ = parse_args(["--engine", "emulator", "--concurrency", "auto,8"])
    assert options.concurrency == [AUTO_CONCURRENCY, 8]


def test_a_plan_point_without_a_plan_is_refused_before_any_engine_starts() -> None:
    settings = Settings(engine="emulator")
    with pytest.raises(GenfleetError, match="no engine plan"):
        start_engine(settings, TuneConfig(mtp=False, plan_scale=1.0))


@pytest.mark.parametrize(
    ("argv", "says"),
    [
        (["--engine", "sglang", "--model", "/m", "--sglang-version", "0.5.11"], "0.5.12 or later"),
        (["--engine", "command", "--engine-command", "x --port {port}"], "sglang or emulator"),
        (["--engine", "sglang", "--model", "/m", "--speculative-eagle-topk", "2"], "topk 1"),
    ],
)
def test_adaptive_refused_where_the_engine_would_not_run_it(argv: list[str], says: str) -> None:
    with pytest.raises(ValueError, match=says):
        parse_args(["--mtp", "on,adaptive", *argv])
    options, _ = parse_args(["--mtp", "adaptive", "--engine", "emulator"])
    assert options.configs == [TuneConfig(mtp=True, adaptive=True)]
    options, _ = parse_args(["--mtp", "adaptive", "--engine", "sglang", "--model", "/m",
                             "--sglang-version", "0.5.12"])  # fmt: skip
    assert options.configs == [TuneConfig(mtp=True, adaptive=True)]


@pytest.mark.parametrize(
    ("streamed", "window", "expected"),
    [
        ([(1.0, 10), (9.0, 10)], (0.0, 10.0), 20),  # inside
        ([(-1.0, 10), (5.0, 10)], (0.0, 10.0), 10),  # one before the window
        ([(5.0, 10), (10.5, 10)], (0.0, 10.0), 10),  # one after it
        ([(0.0, 4), (10.0, 4)], (0.0, 10.0), 8),  # on both edges
        ([(2.0, 8), (3.0, -2)], (0.0, 10.0), 6),  # a usage figure corrects an estimate
        ([], (0.0, 10.0), 0),
    ],
)
def test_tokens_in_window(
    streamed: list[tuple[float, int]], window: tuple[float, float], expected: int
) -> None:
    assert tokens_in_window(streamed, *window) == expected


@pytest.mark.parametrize(
    ("requests", "window", "expected"),
    [
        ([(0.0, 10.0, 100)], (0.0, 10.0), 100.0),  # wholly inside
        ([(-5.0, 5.0, 100)], (0.0, 10.0), 50.0),  # straddles the start
        ([(5.0, 15.0, 100)], (0.0, 10.0), 50.0),  # straddles the end
        ([(-5.0, 15.0, 200)], (0.0, 10.0), 100.0),  # spans the window
        ([(11.0, 12.0, 100)], (0.0, 10.0), 0.0),  # after it
        ([(3.0, 3.0, 7)], (0.0, 10.0), 7.0),  # instant, inside
    ],
)
def test_answer_tokens_in_window(
    requests: list[tuple[float, float, int]], window: tuple[float, float], expected: float
) -> None:
    assert answer_tokens_in_window(requests, *window) == pytest.approx(expected)


@pytest.mark.parametrize(
    ("usage", "finished", "expected"),
    [
        (True, [(0.0, 10.0, 100)], 64),  # the engine counts its tokens: the streamed ones
        (False, [], 64),  # nothing ended yet: the streamed estimate is all there is
        (False, [(0.0, 10.0, 100)], 100.0),  # no counts: the answers that ended
    ],
)
def test_a_window_counts_streamed_tokens_where_the_engine_counts_them(
    usage: bool, finished: list[tuple[float, float, int]], expected: float
) -> None:
    live = Live(finished=finished, streamed=[(1.0, 32), (2.0, 32)], usage_streamed=usage)
    assert window_tokens(live, 0.0, 10.0) == pytest.approx(expected)


@pytest.mark.parametrize(
    ("points", "fastest", "frugal"),
    [
        # the fastest and the most frugal differ
        ([point("on", 1, 100, 120), point("on", 64, 1000, 600)], ("on", 64), ("on", 64)),
        ([point("on", 1, 100, 20), point("on", 64, 1000, 600)], ("on", 64), ("on", 1)),
        # errors on more than 1 % of requests disqualify; no power: no energy winner
        ([point("off", 8, 900, errors=5), point("off", 4, 500)], ("off", 4), ("off", 4)),
        ([point("off", 8, 900, None)], ("off", 8), None),
        # a tie goes to the lower concurrency
        ([point("off", 16, 500), point("off", 8, 500)], ("off", 8), ("off", 8)),
        ([], None, None),
    ],
)
def test_best(
    points: list[Point], fastest: tuple[str, int] | None, frugal: tuple[str, int] | None
) -> None:
    got = best(points)
    assert [(p.config, p.concurrency) if p else None for p in got] == [fastest, frugal]


@pytest.mark.parametrize(
    ("kw", "text"),
    [
        ({}, "ok"),
        ({"verdict": "underused", "cause": "client_limited"}, "underused: client_limited"),
        (
            {"verdict": "underused", "cause": "mtp_off", "other_causes": ("client_limited",)},
            "underused: mtp_off (+client_limited)",
        ),
    ],
)
def test_verdict_text(kw: dict[str, object], text: str) -> None:
    assert verdict_text(point("on", 1, 10, **kw)) == text


def test_table_rows_mark_the_winners() -> None:
    rows = table_rows([point("on", 1, 100, 70), point("off", 128, 2000, 630)])
    assert rows == [
        ["on", "1", "100", "70", "10", "0.7", "–", "100", "ok", ""],
        ["off", "128", "2,000", "630", "90", "0.315", "–", "100", "ok", "★ tok/s ★ J/token"],
    ]
    md = markdown_table([point("on", 1, 100, None, errors=2)]).splitlines()
    assert md[0].startswith("| MTP | C | tok/s | W | % of limit | J/token |")
    assert md[2] == "| on | 1 | 100 | – | – | – | – | 100 (2 err) | ok |  |"


def test_a_gpu_hour_price_adds_the_cost_per_million_tokens() -> None:
    """3.6 USD an hour over 1,000 tok/s (3.6 M tokens an hour) is 1 USD per million; a
    tensor-parallel pair costs twice as much per token at the same rate."""
    points = [point("on", 64, 1000, 630), point("off", 1, 0, 80)]
    rows = table_rows(points, gpu_hour_cost=3.6)
    assert [r[6] for r in rows] == ["1", "–"]
    assert table_rows(points[:1], gpu_hour_cost=3.6, gpus=2)[0][6] == "2"
    md = markdown_table(points, gpu_hour_cost=3.6).splitlines()
    assert md[0].startswith("| MTP | C | tok/s | W | % of limit | J/token | USD/M tok | accept |")
    assert len(md[2].split("|")) == len(md[0].split("|"))


@pytest.mark.parametrize(
    ("engine", "chosen", "lines"),
    [
        (
            "emulator",
            point("on", 128, 3000, max_running_requests=256),
            ["GENFLEET_MTP=true", "GENFLEET_MAX_RUNNING_REQUESTS=256", "GENFLEET_MAX_INFLIGHT=128"],
        ),
        ("command", point("off", 64, 700), ["GENFLEET_MTP=false", "GENFLEET_MAX_INFLIGHT=64"]),
        (
            "sglang",
            point("on:48", 32, 900, max_running_requests=48),
            ["GENFLEET_MTP=true", "GENFLEET_MAX_RUNNING_REQUESTS=48", "GENFLEET_MAX_INFLIGHT=32"],
        ),
        (
            "emulator",
            point("adaptive", 64, 2000, max_running_requests=256),
            [
                "GENFLEET_MTP=true",
                "GENFLEET_SPECULATIVE_ADAPTIVE=true",
                "GENFLEET_MAX_RUNNING_REQUESTS=256",
                "GENFLEET_MAX_INFLIGHT=64",
            ],
        ),
    ],
)
def test_settings_file_round_trips(
    tmp_path: Path, engine: str, chosen: Point, lines: list[str]
) -> None:
    now = datetime(2026, 1, 2, 3, 4, tzinfo=UTC)
    text = settings_file_text(chosen, engine=engine, model="m", objective="throughput", now=now)
    assert text.startswith("# genfleet tune, 2026-01-02 03:04 UTC: engine")
    assert [line for line in text.splitlines() if not line.startswith("#")] == lines
    path = tmp_path / "tuned.env"
    path.write_text(text)
    settings = Settings.from_overrides({"settings_file": str(path)})
    assert settings.max_inflight == chosen.concurrency
    assert settings.mtp is (not chosen.config.startswith("off"))
    assert settings.speculative_adaptive is chosen.config.startswith("adaptive")


def test_parse_args_splits_tune_flags_from_settings() -> None:
    options, settings = parse_args(
        ["--mtp", "on:48,off", "--concurrency", "2,8", "--duration-s=3", "--max-tokens", "99"]
    )
    assert [c.label for c in options.configs] == ["on:48", "off"]
    assert options.concurrency == [2, 8]
    assert options.duration_s == 3.0
    assert settings.max_tokens == 99
    default, _ = parse_args(["--engine", "command", "--engine-command", "x --port {port}"])
    assert [c.label for c in default.configs] == ["off"]
    with pytest.raises(ValueError, match="external"):
        parse_args(["--engine", "external", "--engine-url", "http://h:1"])


@pytest.mark.parametrize(
    ("argv", "out", "json_path", "json_stdout"),
    [
        ([], "tuned.env", None, False),
        (["--settings-out", "a.env", "--json-out", "r.json", "--json"], "a.env", "r.json", True),
        (["--json", "--settings-out=b.env"], "b.env", None, True),
    ],
)
def test_tune_flags_have_one_meaning(
    argv: list[str], out: str, json_path: str | None, json_stdout: bool
) -> None:
    options, _ = parse_args(argv)
    assert str(options.out) == out
    assert (str(options.json_path) if options.json_path else None) == json_path
    assert options.json_stdout is json_stdout


@pytest.mark.parametrize(
    ("argv", "says"),
    [
        (["--out", "tuned.env"], "No such option: --out"),
        (["--json", "results.json"], "unexpected extra argument"),
        (["--json=results.json"], "does not take a value"),
    ],
)
def test_old_file_flags_are_refused(argv: list[str], says: str) -> None:
    """`--out FILE` and `--json FILE` once named tune's files; now they fail, never write."""
    with pytest.raises(Exception, match=says) as refused:
        parse_args(argv)
    assert type(refused.value).__name__ in {"NoSuchOption", "UsageError", "BadOptionUsage"}


def sweep_env(tmp_path: Path) -> dict[str, str]:
    """The bare environment of an emulator sweep: nothing of this shell, logs in tmp_path."""
    return {
        "PYTHONPATH": str(ROOT),
        "PATH": "/usr/bin:/bin",
        "GENFLEET_EMULATOR_TIME_SCALE": "10",
        "GENFLEET_EMULATOR_LOAD_S": "0.2",
        "GENFLEET_EMULATOR_WARMUP_S": "0.2",
        "GENFLEET_EMULATOR_MEAN_COMPLETION_TOKENS": "300",
        "GENFLEET_MAX_TOKENS": "1024",
        "GENFLEET_LOG_DIR": str(tmp_path / "logs"),
        "GENFLEET_PORT": str(engine_port_base()),
        "TMPDIR": tempfile.gettempdir(),
    }


@pytest.mark.integration
@pytest.mark.slow
def test_emulator_sweep_shows_the_mtp_trade_off(tmp_path: Path) -> None:
    env = sweep_env(tmp_path)
    results = tmp_path / "tune.json"
    tuned = tmp_path / "tuned.env"
    argv = [sys.executable, "-m", "genfleet.workers", "tune", "--engine", "emulator"]
    argv += ["--mtp", "on:48,off", "--concurrency", "1,256", "--duration-s", "3"]
    argv += ["--warmup-s", "0.5", "--ramp-s", "3", "--drain-s", "20"]
    argv += ["--json-out", str(results), "--settings-out", str(tuned), "--json"]
    done = subprocess.run(argv, env=env, cwd=tmp_path, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stderr[-3000:]
    points = {(p["config"], p["concurrency"]): p for p in json.loads(results.read_text())["points"]}
    tps = {key: p["tokens_per_s"] for key, p in points.items()}
    assert tps[("on:48", 1)] > 1.4 * tps[("off", 1)]  # MTP wins with one request in flight
    assert tps[("on:48", 256)] < 0.95 * tps[("off", 256)]  # and loses, capped at 48, at 256
    assert points[("on:48", 1)]["accept_length"] > 2.0
    assert points[("off", 1)]["verdict"] == "underused"
    assert points[("off", 1)]["cause"] == "mtp_off"
    assert points[("on:48", 256)]["verdict"] == "ok"  # saturated at its cap: power is high
    assert "GENFLEET_MTP=false" in tuned.read_text()  # off at C=256 is the fastest point
    assert "genfleet tune" in done.stderr and "★ tok/s" in done.stderr  # the table
    assert json.loads(done.stdout) == json.loads(results.read_text())  # --json: stdout is JSON


@pytest.mark.integration
@pytest.mark.slow
def test_emulator_sweep_shows_adaptive_as_its_own_point(tmp_path: Path) -> None:
    """Adaptive drafts like MTP with one request in flight and not at all with 128 running."""
    env = sweep_env(tmp_path)
    results = tmp_path / "tune.json"
    argv = [sys.executable, "-m", "genfleet.workers", "tune", "--engine", "emulator"]
    argv += ["--mtp", "on,adaptive,off", "--concurrency", "1,128", "--duration-s", "3"]
    argv += ["--warmup-s", "0.5", "--ramp-s", "3", "--drain-s", "20", "--json-out", str(results)]
    done = subprocess.run(argv, env=env, cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    points = {(p["config"], p["concurrency"]): p for p in json.loads(results.read_text())["points"]}
    tps = {key: p["tokens_per_s"] for key, p in points.items()}
    assert tps[("adaptive", 1)] > 1.4 * tps[("off", 1)]  # drafts at one request in flight
    assert points[("adaptive", 1)]["accept_length"] > 2.0
    assert tps[("adaptive", 128)] == pytest.approx(tps[("off", 128)], rel=0.1)  # none at 128
    assert points[("adaptive", 128)]["accept_length"] == pytest.approx(1.0, abs=0.05)
    assert points[("adaptive", 128)]["cause"] != "mtp_ineffective"  # its choice, not a fault
    assert points[("adaptive", 128)]["power_w"] == pytest.approx(
        points[("off", 128)]["power_w"], rel=0.05
    )
    assert points[("on", 128)]["accept_length"] > 2.0  # fixed MTP keeps drafting


@pytest.mark.integration
def test_a_window_shorter_than_the_answers_reads_the_engine_s_rate(tmp_path: Path) -> None:
    """Answers of ~4,000 tokens at 8 running take ~7 s here; the window is 2 s and the drain
    0.5 s, so few end inside it. The rate is the tokens streamed in the window: near the
    emulator's modelled 8 / 14 ms × 10 (MTP off), not the few answers that ended."""
    env = sweep_env(tmp_path) | {
        "GENFLEET_EMULATOR_MEAN_COMPLETION_TOKENS": "4000",
        "GENFLEET_MAX_TOKENS": "8192",
    }
    results = tmp_path / "tune.json"
    argv = [sys.executable, "-m", "genfleet.workers", "tune", "--engine", "emulator"]
    argv += ["--mtp", "off", "--concurrency", "8", "--duration-s", "2", "--warmup-s", "0"]
    argv += ["--ramp-s", "0.5", "--drain-s", "0.5", "--json-out", str(results)]
    done = subprocess.run(argv, env=env, cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    (point,) = json.loads(results.read_text())["points"]
    assert point["requests"] < 16  # most answers did not end inside the window
    modelled = 8 / (12.0 + 0.25 * 8) * 1000 * 10
    assert 0.5 * modelled < point["tokens_per_s"] < 1.2 * modelled


@pytest.mark.integration
@pytest.mark.parametrize("after_s", [0.0, 1.0], ids=["starting", "measuring"])
def test_an_interrupted_sweep_keeps_its_points_and_stops_its_engine(
    tmp_path: Path, after_s: float
) -> None:
    """SIGTERM (a `timeout`, a scheduler's stop) while the second configuration's engine
    starts, or is measured: the first one's points are written with `interrupted`, no settings
    file claims a choice, and that engine is stopped."""
    env = sweep_env(tmp_path)
    results, tuned = tmp_path / "tune.json", tmp_path / "tuned.env"
    argv = [sys.executable, "-m", "genfleet.workers", "tune", "--engine", "emulator"]
    argv += ["--mtp", "on,off", "--concurrency", "1,4", "--duration-s", "1.5"]
    argv += ["--warmup-s", "0.5", "--ramp-s", "0.5", "--drain-s", "20"]
    argv += ["--json-out", str(results), "--settings-out", str(tuned)]
    sweep = subprocess.Popen(argv, env=env, cwd=tmp_path, stderr=subprocess.PIPE, text=True)
    logs = tmp_path / "logs"
    deadline = time.monotonic() + 120
    while not (second := list(logs.glob("tune-off-*.log"))):  # the second engine's log
        assert sweep.poll() is None and time.monotonic() < deadline, "the sweep ended first"
        time.sleep(0.1)
    port = int(second[0].stem.rsplit("-", 1)[1])
    time.sleep(after_s)
    sweep.send_signal(signal.SIGTERM)
    _, stderr = sweep.communicate(timeout=60)
    assert sweep.returncode == 130, stderr[-3000:]
    data = json.loads(results.read_text())
    assert data["interrupted"] is True
    assert {(p["config"], p["concurrency"]) for p in data["points"]} >= {("on", 1), ("on", 4)}
    assert all(p["config"] in {"on", "off"} for p in data["points"])
    assert not tuned.exists()
    with pytest.raises(OSError):  # the emulator the sweep was measuring no longer listens
        socket.create_connection(("127.0.0.1", port), timeout=1).close()


def test_a_radix_point_keeps_sglangs_own_split_with_the_ratio_it_names(tmp_path: Path) -> None:
    """`off:radix/4` is the argv before the plan (radix cache on, SGLang's cap) with
    `--mamba-full-memory-ratio 4`; `off:plan` the plan's cap with the radix cache off."""
    (tmp_path / "config.json").write_text(json.dumps(qwen35_27b()))
    settings = Settings(engine="sglang", model=str(tmp_path), plan_gpu="h100", max_tokens=512)
    arch = "Qwen3_5ForConditionalGeneration"

    radix, radix_plan = point_settings(settings, parse_configs("off:radix/4")[0], arch)
    plan_point, plan = point_settings(settings, parse_configs("off:plan")[0], arch)

    argv = sglang_launch(radix, 30000, "0.5.15", arch=arch, plan=radix_plan).argv
    assert radix_plan is not None and not radix_plan.planned
    assert "--disable-radix-cache" not in argv and "extra_buffer" in argv
    assert argv[argv.index("--mamba-full-memory-ratio") + 1] == "4"
    assert argv[argv.index("--mem-fraction-static") + 1] == "0.9"
    assert plan is not None and plan.planned
    assert plan_point.max_running_requests == plan.max_running_requests == 98
    argv = sglang_launch(plan_point, 30000, "0.5.15", arch=arch, plan=plan).argv
    assert "--disable-radix-cache" in argv and "--mamba-full-memory-ratio" not in argv
    assert argv[argv.index("--max-running-requests") + 1] == str(plan.max_running_requests)


def test_a_radix_point_on_a_model_without_a_plan_is_refused() -> None:
    with pytest.raises(GenfleetError, match="no engine plan"):
        point_settings(Settings(engine="emulator"), TuneConfig(mtp=False, radix=True), None)


class SpinningClient:
    """A request whose code runs a second with no `await` (an HTTP library's bookkeeping),
    then waits for its answer; it counts where an interrupt reached it."""

    def __init__(self) -> None:
        self.spinning = threading.Event()
        self.torn = 0  # a KeyboardInterrupt raised inside the request's code
        self.cancelled = 0  # cancelled at an await, as asyncio cancels
        self.closed = False

    async def chat(self, record: PromptRecord, params: GenerationParams, **_: Any) -> None:
        self.spinning.set()
        try:
            until = time.monotonic() + 1.0
            while time.monotonic() < until:
                pass
        except KeyboardInterrupt:
            self.torn += 1
            raise
        try:
            await asyncio.sleep(30)
        except asyncio.CancelledError:
            self.cancelled += 1
            raise

    async def aclose(self) -> None:
        self.closed = True


class NoGpu:
    available = True
    reason = None

    def sample(self) -> list[GpuSample]:
        return []


def test_a_sigterm_while_a_point_runs_cancels_its_requests_at_an_await() -> None:
    """The sweep's SIGTERM handler raises KeyboardInterrupt where it lands; while a point's
    requests run that could be inside an HTTP library's code (a lock held, a connection
    half-updated) whose cleanup then never ends. Here the signal arrives while a request's
    code runs with no await: it finishes that code, is cancelled at its next await, the
    client is closed, and the sweep gets its KeyboardInterrupt after the point's loop."""
    client = SpinningClient()
    record = PromptRecord("p0", [{"role": "user", "content": "q"}])
    load = Load(
        client=cast(EngineClient, client),
        prompts=itertools.repeat(record),
        params=GenerationParams(max_tokens=16, temperature=0.0, top_p=1.0, thinking=False),
        concurrency=1,
        seconds=60.0,
        ramp_s=0.0,
        drain_s=0.0,
    )
    reader = cast(EngineReader, type("Reader", (), {"read": lambda self: {}})())

    def sweep_handler(signum: int, frame: object) -> None:
        raise KeyboardInterrupt

    def send_when_spinning() -> None:
        if client.spinning.wait(30):
            time.sleep(0.2)
            os.kill(os.getpid(), signal.SIGTERM)

    previous: Callable[..., Any] | int | None = signal.signal(signal.SIGTERM, sweep_handler)
    sender = threading.Thread(target=send_when_spinning, daemon=True)
    try:
        sender.start()
        started = time.monotonic()
        with pytest.raises(KeyboardInterrupt):
            measure(load, cast(Sampler, NoGpu()), reader, lambda text, done_s: None, "C=1")
        took_s = time.monotonic() - started
        handler_after = signal.getsignal(signal.SIGTERM)
    finally:
        sender.join(timeout=5)
        signal.signal(signal.SIGTERM, previous)
    assert client.torn == 0 and client.cancelled == 1 and client.closed
    assert took_s < 20  # not the point's 60 s, nor the request's 30
    assert handler_after is sweep_handler  # the sweep's own handler back after the point


def test_a_sigterm_swallowed_where_it_landed_still_stops_the_sweep_at_its_next_step() -> None:
    """The handler's KeyboardInterrupt can land where Python swallows it (an at-fork hook of
    Popen's fork, a finalizer: "Exception ignored in"), and the sweep went on to its end with
    exit 0. The signal is noted too: the next step (an engine started, a point about to run)
    stops the sweep."""
    stop_if_interrupted()  # nothing sent: goes on
    with contextlib.suppress(KeyboardInterrupt):  # swallowed where it landed
        tune_command._interrupt(signal.SIGTERM, None)
    try:
        with pytest.raises(KeyboardInterrupt):
            stop_if_interrupted()
    finally:
        tune_command._INTERRUPTS.clear()
