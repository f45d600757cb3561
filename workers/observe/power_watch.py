"""The power-watch beat task's edges: gather every worker's window, join the queue, diagnose.

The diagnosis itself is the pure `observe.diagnosis.diagnose`; this module only collects its
inputs (the summaries workers push, `observe.pushed`; queue depth and pending batches from
Redis) and sends its output to the log, a bounded Redis stream and the task result (Flower).
"""

from __future__ import annotations

import logging
import time
from dataclasses import replace
from typing import Any

import orjson
import redis
from celery import Celery

from genfleet.common import fleet_registry, keys, run_registry, summaries
from genfleet.common.findings import record as record_finding
from genfleet.common.ledger import Ledger
from genfleet.common.queue_depth import orders_waiting
from genfleet.common.redis_conn import connect, text
from genfleet.common.settings import Settings
from genfleet.workers.observe import pushed
from genfleet.workers.observe.diagnosis import FleetState, dedupe, diagnose, verdicts
from genfleet.workers.observe.headlines import watch_headlines
from genfleet.workers.observe.node import node_rows

log = logging.getLogger("genfleet.power_watch")

FORGET_WORKER_S = 600.0


def fleet_state(client: redis.Redis, settings: Settings, now: float) -> FleetState:
    """Queue depth, batches waiting per run, and the workers seen in the last ten minutes."""
    pending: dict[str, int] = {}
    staging: dict[str, float] = {}
    for run in run_registry.runs(client):
        count = Ledger(client).queued_count(run)
        if count:
            pending[run] = count
        since = client.get(keys.staging_key(run))
        if since is not None:
            staging[run] = float(since)
    seen = fleet_registry.seen(client)
    expected = frozenset(w for w, ts in seen.items() if now - ts < FORGET_WORKER_S)
    queues = {text(name) for name in client.smembers(keys.work_queues_key())}
    return FleetState(
        queue_depth=orders_waiting(client, sorted(queues)),
        pending_batches=pending,
        expected_workers=expected,
        staging=staging,
    )


def snapshot(
    settings: Settings, client: redis.Redis, now: float
) -> tuple[dict[str, dict[str, Any]], FleetState]:
    """Every worker's pushed summary and the fleet's queue state. The workers expected are
    those the registry holds (heard within FORGET_S); a silent one is expected, unsampled."""
    found = summaries.read(client, settings.summary_ttl_s)
    pushed.prune(client, found)
    pipe = client.pipeline()
    fleet_registry.heard(pipe, found.samples, now)
    seen = fleet_registry.seen(client)  # before this beat's stamps: they are in `pipe`
    forgotten = [w for w, ts in seen.items() if now - ts >= FORGET_WORKER_S]
    fleet_registry.forget(pipe, forgotten)  # seen by this beat's clock only
    pipe.execute()
    fleet = fleet_state(client, settings, now)
    return found.samples, replace(
        fleet,
        expected_workers=frozenset(found.samples) | frozenset(found.silent_s),
        starting_nodes=frozenset(found.starting_nodes),
        silent_s=found.silent_s,
    )


def run_power_watch(app: Celery, settings: Settings) -> dict[str, Any]:
    """The beat task's body (`app` is the Celery app it runs in; nothing is broadcast)."""
    return watch_pass(connect(settings), settings, time.time())


def watch_pass(client: redis.Redis, settings: Settings, now: float) -> dict[str, Any]:
    """One power-watch round over the pushed summaries: diagnose, dedupe, record findings."""
    samples, fleet = snapshot(settings, client, now)
    stale_after_s = settings.summary_ttl_s
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
        record_finding(pipe, data, settings.findings_maxlen)
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
