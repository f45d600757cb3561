"""A fleet on two nodes (harness/nodes.py) and the faults that only two hosts can have.

Node 1 is the root namespace: a redis-server (password, AOF) bound to 127.0.0.1 and to the
link's root address, a moto S3 server on the link's root address, the control worker (beat,
reaper) and node 1's GPU workers. Node 2 is a network namespace: its GPU workers reach Redis
and S3 over the veth only, each with its emulator engine on the namespace's own 127.0.0.1,
and, with `clock_offset_s`, a wall clock that far off (libfaketime). `control_clock_offset_s`
puts the control worker's clock off instead: the reaper's host.

`play` runs one scenario on a fleet: a run is staged and, once node 2 holds batches,

- "cut": node 2's link drops every packet for longer than a lease, then heals once node 1
  wrote the batches node 2 held; node 2's late copies find their outputs written and are
  refused by the write-once put;
- "lose": node 2's link is cut, every process inside it SIGKILLed at once, the veth taken
  down: a host that lost its power (Redis keeps its connections: no FIN reaches it);
- "none": nothing (a clock scenario's plain run).

Each ends with every prompt exactly once in the store, no batch parked, and figures: how
long node 2's batches waited before node 1 held them (`recover_s`, against the bound the
lease and the reaper set), how many the reaper sent again, how many late copies the
write-once put refused. `tests/faults/test_fault_nodes.py` and `bench/multinode.py` play them.
"""

from __future__ import annotations

import contextlib
import datetime
import os
import re
import tempfile
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import orjson
import redis

from genfleet.common import counters, keys
from genfleet.common.celery_config import GENERATE_TASK
from genfleet.common.redis_conn import text
from genfleet.common.settings import Settings
from harness.assertions import assert_exactly_once
from harness.control import answering, running_batches
from harness.env import base_env, free_port
from harness.nodes import Node, clock_env, second_node
from harness.processes import Worker
from harness.runs import fault_settings, leases_of, open_run_store, outputs, stage, wait_run_done
from harness.services import RedisServer
from harness.sources import write_prompts
from harness.waits import wait_for

FAULTS = ("cut", "lose", "none")
# Short leases and a fast reaper so that a fault is over in seconds; a 25-prompt batch lasts
# a few seconds at this emulator speed, so a fault lands while node 2's batches run.
WORKER_SETTINGS: dict[str, Any] = {
    "lease_ttl_s": 4,
    "reaper_interval_s": 1,
    "emulator_time_scale": 4,
    "checkpoint_interval_s": 1,
    "max_deliveries": 10,
    "batch_retries": 20,
}


SLACK_S = 2.0  # over `recovery_bound_s`: a beat late on a loaded two-core machine


def recovery_bound_s(lease_ttl_s: float, reaper_interval_s: float) -> float:
    """How long a batch of a node that went silent may wait before another node holds it:
    its lease lapses (one TTL), the reaper confirms the lapse on a second look half a lease
    later (`reaper.lapse_confirmed`), its beat comes at most one interval after that, and a
    free worker takes the re-sent order (one more interval of slack for a loaded machine).

    >>> recovery_bound_s(4, 1)
    8.0
    """
    return 1.5 * lease_ttl_s + 2 * reaper_interval_s


@dataclass
class TwoNodes:
    """The services and workers of a two-node fleet; `close()` stops them all."""

    root: Path
    node: Node
    redis: RedisServer
    s3_url: str  # moto, on the link's root address: both nodes reach it there
    store_url: str
    clock_offset_s: int = 0  # node 2's wall clock, off the real one by this much
    control_clock_offset_s: int = 0  # the control worker's (on node 1)
    knobs: dict[str, Any] = field(default_factory=dict)
    control: Worker | None = None
    workers: dict[int, list[Worker]] = field(default_factory=lambda: {1: [], 2: []})

    def env(self, on: int, hostname: str, offset_s: int = 0) -> dict[str, str]:
        """The environment of a worker of node `on` (1 or 2), its clock `offset_s` off."""
        redis_url = self.redis.url if on == 1 else self.redis.url_at(self.node.root_ip)
        values = base_env(
            redis_url,
            self.store_url,
            s3_endpoint_url=self.s3_url,
            log_dir=self.root,
            port=free_port(),
            **{**WORKER_SETTINGS, **self.knobs},
        )
        if offset_s:
            values.update(clock_env(offset_s))
        return values

    def start_worker(self, on: int, role: str = "worker") -> Worker:
        hostname = f"{role}-{uuid.uuid4().hex[:6]}@node{on}"
        prefix = self.node.wrap([]) if on == 2 else []
        worker = Worker(
            self.env(on, hostname, self.offset_s(on, role)),
            self.root / f"{hostname}.log",
            hostname,
            [role],
            prefix=prefix,
            broker_url=self.redis.url,
        )
        if role == "control":
            self.control = worker
        else:
            self.workers[on].append(worker)
        return worker

    def offset_s(self, on: int, role: str) -> int:
        """How far off the clock of a `role` worker of node `on` is."""
        if role == "control":
            return self.control_clock_offset_s
        return self.clock_offset_s if on == 2 else 0

    def hostnames(self, on: int) -> set[str]:
        return {w.hostname for w in self.workers[on]}

    def settings(self) -> Settings:
        """The producer's (and the test's own) view: Redis on 127.0.0.1, S3 on the link."""
        return fault_settings(self.redis.url, self.store_url, s3_endpoint_url=self.s3_url)

    @property
    def lease_ttl_s(self) -> float:
        return float({**WORKER_SETTINGS, **self.knobs}["lease_ttl_s"])

    @property
    def reaper_interval_s(self) -> float:
        return float({**WORKER_SETTINGS, **self.knobs}["reaper_interval_s"])

    def close(self) -> None:
        if self.node.is_cut:
            with contextlib.suppress(Exception):
                self.node.heal()  # node 2's workers then stop in their own time
        for worker in [*self.workers[1], *self.workers[2], *filter(None, [self.control])]:
            worker.stop(timeout_s=10)
        self.redis.kill()


@contextlib.contextmanager
def two_nodes(
    root: Path | None = None,
    per_node: int = 1,
    clock_offset_s: int = 0,
    control_clock_offset_s: int = 0,
    **knobs: Any,
) -> Iterator[TwoNodes]:
    """A two-node fleet, every worker ready: the control worker and `per_node` GPU workers on
    node 1, `per_node` on node 2. Everything, the namespace included, is gone after it."""
    import boto3
    from moto.server import ThreadedMotoServer

    os.environ.setdefault("AWS_ACCESS_KEY_ID", "testing")
    os.environ.setdefault("AWS_SECRET_ACCESS_KEY", "testing")
    os.environ.setdefault("AWS_DEFAULT_REGION", "us-east-1")
    base = root or Path(tempfile.mkdtemp(prefix="genfleet-nodes-"))
    (base / "redis").mkdir(parents=True, exist_ok=True)
    with second_node() as node:
        server = RedisServer(
            base / "redis", free_port(), uuid.uuid4().hex, bind=("127.0.0.1", node.root_ip)
        )
        server.start()
        port = free_port()
        moto = ThreadedMotoServer(ip_address=node.root_ip, port=port, verbose=False)
        moto.start()
        s3_url = f"http://{node.root_ip}:{port}"
        bucket = f"nodes-{uuid.uuid4().hex[:12]}"
        boto3.client("s3", endpoint_url=s3_url, region_name="us-east-1").create_bucket(
            Bucket=bucket
        )
        fleet = TwoNodes(
            base,
            node,
            server,
            s3_url,
            f"s3://{bucket}/runs",
            clock_offset_s,
            control_clock_offset_s,
            knobs,
        )
        try:
            fleet.start_worker(1, "control")
            for on in (1, 2):
                for _ in range(per_node):
                    fleet.start_worker(on)
            for worker in [fleet.control, *fleet.workers[1], *fleet.workers[2]]:
                assert worker is not None
                worker.wait_ready(120)
            yield fleet
        finally:
            fleet.close()
            moto.stop()


@dataclass
class Figures:
    """What one scenario measured."""

    fault: str
    clock_offset_s: int  # node 2's
    prompts: int
    control_clock_offset_s: int = 0
    batches: int = 0
    duplicates: int = 0  # records exported twice, or repeated in output objects
    lost: int = 0  # input ids missing from the export
    held: list[str] = field(default_factory=list)  # node 2's batches when the fault came
    resent_s: float | None = None  # fault → the reaper re-sent every held batch
    recover_s: float | None = None  # fault → every held batch held by node 1, or written
    bound_s: float = 0.0  # what resent_s must stay under (`recovery_bound_s`)
    redone: int = 0  # batches the reaper sent again (deliveries that ended with no worker)
    # Late copies whose output the write-once put refused, as the run counts them: node 2's
    # (node 1's copy writes first in these faults), or node 1's should node 2's win.
    refused: int = 0
    node2_wrote: int = 0  # outputs node 2 wrote
    node2_connections: int = 0  # connections Redis still held from node 2 once it was re-sent
    node2_back_s: float | None = None  # heal → node 2's worker answers a ping again
    total_s: float = 0.0  # stage → every output written

    def line(self) -> str:
        def seconds(value: float | None) -> str:
            return "-" if value is None else f"{value:.1f} s"

        return (
            f"{self.fault:<5} clocks: node 2 {self.clock_offset_s:+4d} s, control "
            f"{self.control_clock_offset_s:+4d} s: {self.prompts} prompts "
            f"({self.batches} batches) in {self.total_s:.1f} s, duplicates {self.duplicates}, "
            f"lost {self.lost}; node 2 held {len(self.held)}, re-sent after "
            f"{seconds(self.resent_s)} (bound {self.bound_s:.1f} s), held by node 1 after "
            f"{seconds(self.recover_s)}; redone {self.redone}, late copies refused "
            f"{self.refused}; node 2 wrote {self.node2_wrote}, Redis still held "
            f"{self.node2_connections} of its connections, back {seconds(self.node2_back_s)} "
            "after the heal"
        )


def batch_results(client: redis.Redis, run: str) -> list[dict[str, Any]]:
    """The generate tasks' results for `run` in the result backend: one per task id, the
    first to succeed (Celery keeps a success: a copy of the same order that ends later, on
    the other node, leaves it as it is)."""
    found = []
    for key in client.scan_iter(match="celery-task-meta-*", count=500):
        meta = orjson.loads(client.get(key) or b"{}")
        result = meta.get("result")
        if meta.get("name") == GENERATE_TASK and isinstance(result, dict):
            if result.get("run") == run and "batch" in result:
                found.append(result)
    return found


def node2_batches(fleet: TwoNodes, client: redis.Redis, run: str, least: int = 1) -> set[str]:
    """Wait (a minute at most) until node 2 holds `least` batches of `run` with no output and
    a checkpoint part written (they run: past their store reads); returns them."""
    store = open_run_store(fleet.settings())

    def running() -> set[str] | None:
        held = set()
        for hostname in fleet.hostnames(2):
            held |= leases_of(client, run, hostname)
        held -= outputs(store, run)
        held = {b for b in held if any(True for _ in store.list(keys.parts_prefix(run, b)))}
        return held if len(held) >= least else None

    found: set[str] = wait_for(running, 60, f"node 2 to run {least} batches of {run}", 0.05)
    return found


def wait_taken_over(
    fleet: TwoNodes, client: redis.Redis, run: str, held: set[str], since: float
) -> tuple[float, float]:
    """Wait until the reaper re-sent every batch in `held` (each counted in the run's lost
    deliveries), then until each is held by a node-1 worker or written; returns the seconds
    from `since` (monotonic) to each."""
    store = open_run_store(fleet.settings())
    node1 = fleet.hostnames(1)

    def resent() -> bool:
        return held <= {text(k) for k in client.hkeys(keys.lost_key(run))}

    def taken() -> bool:
        left = held - outputs(store, run)
        for hostname in node1:
            left -= leases_of(client, run, hostname)
        return not left

    # Past the bound (and its slack) by a few seconds is a stall: said then, not 2 min later.
    bound_s = recovery_bound_s(fleet.lease_ttl_s, fleet.reaper_interval_s) + SLACK_S
    left_s = bound_s + 5 - (time.monotonic() - since)
    wait_for(resent, left_s, f"the reaper to re-send {sorted(held)} (bound {bound_s:.0f} s)", 0.05)
    resent_s = time.monotonic() - since
    wait_for(taken, 120, f"node 1 to take over {sorted(held)}", 0.05)
    return resent_s, time.monotonic() - since


def log_clock_offset_s(worker: Worker) -> float:
    """How far the clock `worker` logs by is off this process's: the time of its log's last
    stamped line ("[YYYY-MM-DD HH:MM:SS,mmm: ...", its local time) less now (a little less
    than its offset: the line is some seconds old)."""
    stamps = re.findall(
        r"^\[(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d),(\d{3}):", worker.log.read_text(), re.M
    )
    assert stamps, f"no stamped line in {worker.log}"
    day, millis = stamps[-1]
    logged = datetime.datetime.strptime(day, "%Y-%m-%d %H:%M:%S").timestamp() + int(millis) / 1000
    return logged - time.time()


def connections_from(client: redis.Redis, address: str) -> int:
    """How many connections Redis holds from `address` now."""
    return sum(1 for c in client.client_list() if str(c.get("addr", "")).startswith(f"{address}:"))


def play(fleet: TwoNodes, fault: str, run: str, prompts: int, deadline_s: float = 180) -> Figures:
    """Stage `prompts` prompts as `run`, play `fault` (FAULTS) once node 2 runs batches, wait
    for the run and check it: every prompt exactly once, nothing parked."""
    if fault not in FAULTS:
        raise ValueError(f"unknown fault {fault!r}: one of {FAULTS}")
    source = fleet.root / f"{run}.jsonl"
    ids = write_prompts(source, prompts, prefix=f"{run}-")
    settings = fleet.settings()
    store = open_run_store(settings)
    figures = Figures(fault, fleet.clock_offset_s, prompts, fleet.control_clock_offset_s)
    figures.bound_s = recovery_bound_s(fleet.lease_ttl_s, fleet.reaper_interval_s)
    node2 = fleet.hostnames(2)
    with fleet.redis.client() as client:
        started = time.monotonic()
        figures.batches = stage(settings, run, source).batches_total
        held: set[str] = set()
        if fault != "none":
            node2_batches(fleet, client, run)
            fleet.node.cut()
            at = time.monotonic()
            # Every batch node 2 holds as the link goes: leased by it, not written.
            held = set().union(*(leases_of(client, run, h) for h in node2))
            held -= outputs(store, run)
            if fault == "lose":
                fleet.node.kill_all()
                fleet.node.unplug()
            figures.resent_s, figures.recover_s = wait_taken_over(fleet, client, run, held, at)
            assert figures.resent_s <= figures.bound_s + SLACK_S, (
                f"node 2's batches waited {figures.resent_s:.1f} s to be re-sent, past the "
                f"{figures.bound_s:.1f} s that the lease and the reaper allow"
            )
            figures.node2_connections = connections_from(client, fleet.node.node_ip)
            if fault == "cut":
                # Healed once node 1 wrote node 2's batches, and never before a lease passed:
                # node 2's copies then come back late, to outputs already written.
                wait_for(lambda: held <= outputs(store, run), 120, "node 1 to write them", 0.1)
                wait_for(lambda: time.monotonic() - at > 2 * fleet.lease_ttl_s, 60, "a cut")
                fleet.node.heal()
                healed = time.monotonic()
                wait_for(lambda: answering(fleet.redis.url, sorted(node2)), 60, "node 2 back")
                figures.node2_back_s = time.monotonic() - healed
        wait_run_done(settings, client, run, deadline_s, store)
        figures.total_s = time.monotonic() - started
        if fault == "cut":
            # Node 2's late copies end once their store calls get through: refused by the
            # write-once put, or (a copy that had not generated all yet) skipped. Their task
            # results are not kept (the result of a task id that succeeded on node 1 stays),
            # so node 2 is asked what it still runs.
            def ended() -> bool:
                running = running_batches(fleet.redis.url, sorted(node2))
                return running is not None and not running & {f"{run}.{b}" for b in held}

            wait_for(ended, 60, f"node 2's late copies of {sorted(held)} to end", 0.25)
        result, rows = assert_exactly_once(settings, run, ids, client, store)
        parked = client.hgetall(keys.failed_key(run))
        assert not parked, f"batches parked: {parked}"
        figures.redone = len(client.hgetall(keys.lost_key(run)))
        results = batch_results(client, run)
        counters_now = counters.read(client, run)
    exported = [row["id"] for row in rows]
    figures.held = sorted(held)
    figures.duplicates = result.duplicates + len(exported) - len(set(exported))
    figures.lost = len(set(ids) - set(exported))
    figures.refused = int(counters_now.get("waste_late_copies", 0))
    figures.node2_wrote = len(
        {r["batch"] for r in results if r.get("worker") in node2}
        - {r["batch"] for r in _late(results, node2)}
    )
    return figures


def _late(results: list[dict[str, Any]], hostnames: set[str]) -> list[dict[str, Any]]:
    """Results of copies on one of `hostnames` that found their batch's output written: the
    write-once put refused theirs (`duplicate`), or they found it before generating."""
    return [
        r
        for r in results
        if r.get("worker") in hostnames and (r.get("duplicate") or r.get("skipped"))
    ]
