"""On a real NVIDIA GPU: the node's GPUs as NVML lists them, an engine's and a stranger's
processes told apart, and `node_rows` naming the stranger (and any GPU the worker leaves
unclaimed). Deselected by default (`-m gpu` runs it); needs torch to hold GPU memory."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Iterator
from typing import Any

import pytest

from genfleet.workers.observe.diagnosis import FleetState
from genfleet.workers.observe.node import node_rows
from genfleet.workers.observe.sampler import mark_processes
from genfleet.workers.observe.telemetry import NvmlSampler

pytestmark = pytest.mark.gpu

# Holds `mib` MiB on GPU 0 until its stdin closes; says "held" once the memory is there.
HOLD = """
import sys, torch
block = torch.empty(int(sys.argv[1]) * 2**20, dtype=torch.uint8, device="cuda:0")
torch.cuda.synchronize()
print("held", flush=True)
sys.stdin.read()
"""


def holder(mib: int, own_group: bool) -> subprocess.Popen[str]:
    """A process holding GPU memory: in its own process group, as the supervisor starts an
    engine, or in this test's, as a stranger's notebook would be to a worker."""
    pytest.importorskip("torch")
    proc = subprocess.Popen(
        [sys.executable, "-c", HOLD, str(mib)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        start_new_session=own_group,
    )
    assert proc.stdout is not None
    assert proc.stdout.readline().strip() == "held", "the holder could not allocate on GPU 0"
    return proc


@pytest.fixture
def sampler() -> Iterator[NvmlSampler]:
    nvml = NvmlSampler()
    assert nvml.available, nvml.reason
    yield nvml
    nvml.close()


def test_a_stranger_on_the_workers_gpu_and_the_gpus_it_leaves_are_named(
    sampler: NvmlSampler,
) -> None:
    engine = holder(2048, own_group=True)
    stranger = holder(1024, own_group=False)
    try:
        pids = {engine.pid, stranger.pid}
        deadline = time.monotonic() + 30
        while True:  # NVML lists a new context within a second or so
            node = sampler.node_gpus()
            listed = {int(p["pid"]) for p in node[0]["processes"]}
            if pids <= listed or time.monotonic() > deadline:
                break
            time.sleep(0.5)
        print(node)
        assert pids <= listed, f"NVML lists {listed} on GPU 0, not {pids} (pid namespace?)"
        assert [g["index"] for g in node] == list(range(len(node)))
        for gpu in node:
            assert str(gpu["gpu_uuid"]).startswith("GPU-")
            assert 5.0 <= gpu["power_w"] <= gpu["power_limit_w"] * 1.2
        by_pid = {int(p["pid"]): p for p in node[0]["processes"]}
        assert by_pid[stranger.pid]["used_memory_mib"] >= 1024

        marked = mark_processes(node, engine_pid=engine.pid)
        engine_flags = {int(p["pid"]): p["engine"] for p in marked[0]["processes"]}
        assert engine_flags[engine.pid] is True
        assert engine_flags[stranger.pid] is False
        assert {int(p["pid"]): p["name"] for p in marked[0]["processes"]}[stranger.pid]

        now = time.time()
        report: dict[str, Any] = {
            "ts": now,
            "node": os.uname().nodename,
            "gpus": [{"gpu_uuid": node[0]["gpu_uuid"]}],  # the worker claims GPU 0 alone
            "node_gpus": marked,
        }
        found = [finding for _row, finding in node_rows({"w0": report}, FleetState(), now)]
        foreign = [f for f in found if f.cause == "foreign_process"]
        assert [f.numbers["pid"] for f in foreign] == [stranger.pid]
        assert foreign[0].numbers["memory_used_mib"] >= 1024
        unclaimed = sorted(str(f.gpu_uuid) for f in found if f.cause == "unclaimed_gpu")
        assert unclaimed == sorted(str(g["gpu_uuid"]) for g in node[1:])
    finally:
        for proc in (engine, stranger):
            proc.kill()
            proc.wait(30)
