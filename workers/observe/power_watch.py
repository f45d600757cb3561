"""The power-watch beat task's edges: gather every worker's window, join the queue, diagnose.

The diagnosis itself is the pure `observe.diagnosis.diagnose`; this module only collects its
inputs (a `gpu_report` broadcast, queue depth and pending batches from Redis, the workers seen
before) and sends its output to the log, a bounded Redis stream and the task result (Flower).
"""

from __future__ import annotations

import logging
import time
from dataclasses import replace
from typing import Any

import orjson
import redis
from celery import Celery

from genfleet.common import keys
from genfleet.common.ledger import Ledger
from genfleet.common.redis_conn import connect, text
from genfleet.common.settings import Settings
from genfleet.workers.observe.diagnosis import FleetState, dedupe, diagnose, verdicts
from genfleet.workers.observe.headlines import watch_headlines
from genfleet.workers.observe.node import node_rows

log = logging.getLogger("genfleet.power_watch")

FORGET_WORKER_S = 600.0


def queue_depth(client: redis.Redis, queue: str) -> int:
    pipe = client.pipeline()
    for name in keys.broker_queue_keys(queue):
        pipe.llen(name)
    return sum(int(n) for n in pipe.execute())


def fleet_state(client: redis.Redis, settings: Settings, now: float) -> FleetState:
    """Queue depth, batches waiting per run, and the workers seen in the last ten minutes."""
    pending: dict[str, int] = {}
    staging: dict[str, float] = {}
    for member in client.smembers(keys.runs_key()):
        run = text(member)
        count = Ledger(client).queued_count(run)
        if count:
            pending[run] = count
        since = client.get(keys.staging_key(run))
        if since is not None:
            staging[run] = float(since)
    seen = {text(k): float(v) for k, v in client.hgetall(keys.workers_key()).items()}
    expected = frozenset(w for w, ts in seen.items() if now - ts < FORGET_WORKER_S)
    queues = {text(name) for name in client.smembers(keys.work_queues_key())}
    return FleetState(
        queue_depth=sum(queue_depth(client, queue) for queue in sorted(queues)),
        pending_batches=pending,
        expected_workers=expected,
        staging=staging,
    )


def gather(app: Celery, timeout_s: float = 3.0) -> tuple[dict[str, dict[str, Any]], set[str]]:
    """Every GPU worker's `gpu_report`, and the nodes of workers whose engine is not started
    yet (they answer ok: False)."""
    replies = app.control.inspect(timeout=timeout_s)._request("gpu_report") or {}
    samples, starting = {}, set()
    for worker, reply in replies.items():
        if not isinstance(reply, dict):
            continue
        if reply.get("ok", True) is not False:
            samples[worker] = reply
        elif reply.get("node"):
            starting.add(str(reply["node"]))
    return samples, starting


def snapshot(
    app: Celery, settings: Settings, client: redis.Redis, now: float
) -> tuple[dict[str, dict[str, Any]], FleetState]:
    samples, starting = gather(app)
    if samples:
        client.hset(keys.workers_key(), mapping={w: now for w in samples})
    fleet = fleet_state(client, settings, now)
    return samples, replace(fleet, starting_nodes=frozenset(starting))


def run_power_watch(app: Celery, settings: Settings) -> dict[str, Any]:
    now = time.time()
    client = connect(settings)
    samples, fleet = snapshot(app, settings, client, now)
    stale_after_s = max(3 * settings.power_watch_interval_s, 10 * settings.sample_interval_s)
    args = (samples, fleet, now, settings.underuse_threshold, settings.min_accept_length)
    nodes = node_rows(samples, fleet, now, stale_after_s)
    findings = diagnose(*args, stale_after_s=stale_after_s) + [f for _, f in nodes]
    rows = verdicts(*args, stale_after_s=stale_after_s) + [r for r, _ in nodes]
    last = {text(k): float(v) for k, v in client.hgetall(keys.alerted_key()).items()}
    new, updated = dedupe(findings, last, now, settings.realert_after_s)
    pipe = client.pipeline()
    pipe.delete(keys.alerted_key())
    if updated:
        pipe.hset(keys.alerted_key(), mapping=updated)  # type: ignore[arg-type]
    for finding in new:
        data = finding.to_json()
        log.warning(
            "UNDERUSED %s %s: %s — %s %s",
            finding.worker,
            finding.gpu_uuid or "",
            finding.cause,
            finding.suggestion,
            orjson.dumps(finding.numbers).decode(),
        )
        pipe.xadd(
            keys.findings_key(),
            {"finding": orjson.dumps(data)},
            maxlen=settings.findings_maxlen,
            approximate=True,
        )
    found = [f.to_json() for f in findings]
    report = {
        "summary": watch_headlines(rows, found),  # first: what Flower shows
        "ts": now,
        "workers": sorted(samples),
        "queue_depth": fleet.queue_depth,
        "pending_batches": fleet.pending_batches,
        "findings": found,
        "new_findings": len(new),
        "verdicts": rows,
    }
    pipe.execute()
    return report
