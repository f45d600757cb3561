"""Every GPU of a node accounted for: `node_rows` as a table, `mark_processes` on real
processes, and an emulated node whose spare GPU no worker claims, seen by `top` and
`genfleet findings` through a real worker."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import orjson
import pytest

from genfleet.workers.observe.diagnosis import FleetState
from genfleet.workers.observe.node import node_rows
from genfleet.workers.observe.sampler import mark_processes
from harness.env import base_env
from harness.processes import Worker
from harness.waits import wait_for
from tests.support.commands import genfleet

NOW = 1_760_000_000.0


def gpu(uuid: str, power_w: float = 80.0, *procs: dict[str, Any]) -> dict[str, Any]:
    return {
        "gpu_uuid": uuid,
        "gpu_name": "NVIDIA H200",
        "power_w": power_w,
        "power_limit_w": 700.0,
        "memory_used_mib": sum(p["used_memory_mib"] for p in procs),
        "processes": list(procs),
    }


def engine(mib: float = 120_000) -> dict[str, Any]:
    return {"pid": 100, "used_memory_mib": mib, "engine": True, "name": "python3"}


def stranger(mib: float = 9_000, engine: bool | None = False) -> dict[str, Any]:
    return {"pid": 200, "used_memory_mib": mib, "engine": engine, "name": "jupyter"}


NODE = [gpu("GPU-0", 650, engine()), gpu("GPU-1", 640, engine()), gpu("GPU-2", 95)]


def report(own: list[str], node: list[dict[str, Any]], name: str = "h1", **extra: Any) -> Any:
    return {
        "ts": NOW,
        "node": name,
        "gpus": [{"gpu_uuid": u} for u in own],
        "node_gpus": node,
        **extra,
    }


# name, reports (worker → summary), fleet state, expected [(worker, gpu, cause)]
CASES: list[tuple[str, dict[str, Any], FleetState, list[tuple[str, str, str]]]] = [
    (
        "every GPU claimed",
        {"w0": report(["GPU-0"], NODE), "w1": report(["GPU-1", "GPU-2"], NODE)},
        FleetState(),
        [],
    ),
    (
        "a GPU no worker claims, reported once though two workers see it",
        {"w0": report(["GPU-0"], NODE), "w1": report(["GPU-1"], NODE)},
        FleetState(),
        [("h1 (no worker)", "GPU-2", "unclaimed_gpu")],
    ),
    (
        "claimed by a worker whose GPU reading failed (its gpu_uuids say so)",
        {"w0": report(["GPU-0", "GPU-1"], NODE), "w2": report([], NODE, gpu_uuids=["GPU-2"])},
        FleetState(),
        [],
    ),
    (
        "a worker on the node is still starting: no verdict on its GPUs yet",
        {"w0": report(["GPU-0", "GPU-1"], NODE)},
        FleetState(starting_nodes=frozenset({"h1"})),
        [],
    ),
    (
        "another node's GPUs are that node's business",
        {"w0": report(["GPU-0", "GPU-1"], NODE[:2]), "w9": report(["GPU-9"], [gpu("GPU-9")], "h2")},
        FleetState(),
        [],
    ),
    (
        "a stranger holds memory on a worker's GPU",
        {"w0": report(["GPU-0", "GPU-1", "GPU-2"], [gpu("GPU-0", 500, engine(), stranger())])},
        FleetState(),
        [("w0", "GPU-0", "foreign_process")],
    ),
    (
        "a stranger on a GPU no worker claims is the unclaimed finding only",
        {"w0": report(["GPU-0"], [gpu("GPU-0", 650, engine()), gpu("GPU-3", 300, stranger())])},
        FleetState(),
        [("h1 (no worker)", "GPU-3", "unclaimed_gpu")],
    ),
    (
        "a process the worker cannot place (another pid namespace) is not blamed",
        {"w0": report(["GPU-0"], [gpu("GPU-0", 500, stranger(engine=None))])},
        FleetState(),
        [],
    ),
    (
        "a stale report says nothing",
        {"w0": {**report(["GPU-0"], NODE), "ts": NOW - 600}},
        FleetState(),
        [],
    ),
]


@pytest.mark.parametrize(
    ("samples", "fleet", "expected"), [c[1:] for c in CASES], ids=[c[0] for c in CASES]
)
def test_node_rows_table(
    samples: dict[str, Any], fleet: FleetState, expected: list[tuple[str, str, str]]
) -> None:
    rows = node_rows(samples, fleet, NOW)
    assert [(f.worker, f.gpu_uuid, f.cause) for _, f in rows] == expected
    assert [(r["worker"], r["gpu_uuid"], r["verdict"]) for r, _ in rows] == expected
    for row, finding in rows:
        assert finding.suggestion and "\n" not in finding.suggestion
        assert row["power_w"] is not None
        if finding.cause == "unclaimed_gpu":
            assert f"{row['power_w']:.0f} W" in finding.suggestion
            assert finding.numbers["node"] == "h1"
        else:
            assert finding.numbers["pid"] == 200 and "jupyter" in finding.suggestion


def test_fleet_state_json_keeps_starting_nodes() -> None:
    state = FleetState(starting_nodes=frozenset({"h1"}))
    assert FleetState.coerce(orjson.loads(orjson.dumps(state.to_json()))) == state


def test_mark_processes_tells_the_engine_group_from_strangers() -> None:
    """A process group like the supervisor's engine (a leader and its child) against this
    test's own process, which is in another group."""
    leader = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import subprocess,sys,time; "
            "c=subprocess.Popen([sys.executable,'-c','import time; time.sleep(60)']); "
            "print(c.pid, flush=True); time.sleep(60)",
        ],
        stdout=subprocess.PIPE,
        start_new_session=True,
    )
    try:
        assert leader.stdout is not None
        child = int(leader.stdout.readline())
        procs = [
            {"pid": leader.pid, "used_memory_mib": 10},
            {"pid": child, "used_memory_mib": 100_000},
            {"pid": os.getpid(), "used_memory_mib": 500},
            {"pid": 2**22 + 7, "used_memory_mib": 1},  # no such pid here
        ]
        (marked,) = mark_processes([{"gpu_uuid": "GPU-0", "processes": procs}], leader.pid)
        assert [p["engine"] for p in marked["processes"]] == [True, True, False, None]
        assert marked["processes"][2]["name"]  # read from /proc
        (unknown,) = mark_processes([{"gpu_uuid": "GPU-0", "processes": procs}], None)
        assert [p["engine"] for p in unknown["processes"]] == [None] * 4
    finally:
        os.killpg(leader.pid, 9)
        leader.wait()


@pytest.mark.integration
@pytest.mark.slow
def test_an_unclaimed_gpu_and_a_stranger_show_in_top_and_findings(
    tmp_path: Path, redis_url: str, start_worker: Callable[..., Worker]
) -> None:
    from genfleet.common.settings import Settings
    from genfleet.workers.app import app
    from genfleet.workers.observe.power_watch import run_power_watch

    store = (tmp_path / "store").as_uri()
    knobs = {"emulator_unclaimed_gpus": 1, "emulator_foreign_process_mib": 2048}
    env = base_env(redis_url, store, sample_interval_s=0.25, **knobs)
    worker = start_worker(env)
    worker.wait_ready()

    def cli_json(*args: str) -> list[dict[str, Any]]:
        result = genfleet([*args, "--json"], env, timeout_s=60)
        assert result.returncode == 0, result.stderr
        text = result.stdout.strip()
        if text.startswith("["):
            return list(orjson.loads(text))
        return [orjson.loads(line) for line in text.splitlines() if line.strip()]

    def top_rows() -> list[dict[str, Any]] | None:
        rows = cli_json("top", "--once")
        return rows if any(r["verdict"] == "unclaimed_gpu" for r in rows) else None

    rows = wait_for(top_rows, 60, "an unclaimed GPU row in top", 1.0)
    (spare,) = [r for r in rows if r["verdict"] == "unclaimed_gpu"]
    assert spare["gpu_uuid"] == "EMU-UNCLAIMED-0" and spare["power_w"] == 80.0
    assert spare["worker"].endswith("(no worker)")
    (foreign,) = [r for r in rows if r["verdict"] == "foreign_process"]
    assert foreign["worker"] == worker.hostname
    mine = [r for r in rows if r["worker"] == worker.hostname and r["verdict"] != "foreign_process"]
    assert [r["gpu_uuid"] for r in mine] == [foreign["gpu_uuid"]]  # its own row stays

    run_power_watch(app, Settings(redis_url=redis_url, store=store))
    findings = cli_json("findings")
    causes = {(f["cause"], f["gpu_uuid"]) for f in findings}
    assert ("unclaimed_gpu", "EMU-UNCLAIMED-0") in causes
    assert ("foreign_process", foreign["gpu_uuid"]) in causes
    stranger = next(f for f in findings if f["cause"] == "foreign_process")
    assert stranger["numbers"]["pid"] == 1 and stranger["numbers"]["memory_used_mib"] == 2048
