"""A run's lifecycle after staging: list the runs, cancel one, delete one.

- `list_runs`: one row per run folder of the store (the truth), with Redis's live state.
- `cancel_run`: sets the run's cancelled flag (workers start no batch of it, running ones
  stop at their next lease refresh, checkpoint and park) and removes its waiting orders.
  Enqueueing the run again resumes it.
- `delete_run`: cancels, waits for running batches to stop, then removes the run's store
  objects, its orders and its Redis keys, and leaves a tombstone so that a stray order of the
  deleted run never reaches a new run of the same name; its retry rounds' runs
  (`genfleet retry RUN --errors …`) go first, the same way.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import redis

from genfleet.common import keys, run_registry
from genfleet.common.errors import GenfleetError, InputError
from genfleet.common.ledger import Ledger
from genfleet.common.manifest import Manifest, current_staging
from genfleet.common.redis_conn import text
from genfleet.common.settings import Settings
from genfleet.common.store import Store
from genfleet.producer.status import run_status


def list_runs(store: Store, client: redis.Redis) -> list[dict[str, Any]]:
    """Every run in the store: run, state, model, engine, prompts, done, failed, created."""
    rows: list[dict[str, Any]] = []
    for name in store.folders():
        try:
            keys.validate_run(name)
        except ValueError:
            continue  # not a run folder
        try:
            report = run_status(store, client, name)  # O(1) once Redis holds its progress
        except InputError:  # no manifest: staging, or not a run
            if store.exists(keys.claim_key(name)):
                rows.append(_row(name, "staging", None, None, None, 0, 0, None))
            continue
        rows.append(
            _row(
                name,
                report["state"],
                report["model"],
                report["engine"],
                report["prompts_total"],
                report["prompts_done"],
                report["batches_failed"],
                report["created_at"],
            )
        )
    return rows


def _row(
    run: str,
    state: str,
    model: str | None,
    engine: str | None,
    prompts: int | None,
    done: int,
    failed: int,
    created_at: float | None,
) -> dict[str, Any]:
    return {
        "run": run,
        "state": state,
        "model": model,
        "engine": engine,
        "prompts": prompts,
        "done": done,
        "failed": failed,
        "created_at": created_at,
    }


def _work_queues(client: redis.Redis) -> list[str]:
    return sorted(text(name) for name in client.smembers(keys.work_queues_key()))


def running_batches(client: redis.Redis, run: str) -> set[str]:
    """Batches of `run` a worker holds a live lease on (they are generating now)."""
    found: set[str] = set()
    prefix = keys.lease_key(run, "")
    for key in client.scan_iter(match=keys.leases_pattern(run), count=500):
        found.add(text(key)[len(prefix) :])
    return found


@dataclass
class CancelResult:
    run: str
    orders_removed: int = 0
    running: list[str] = field(default_factory=list)
    already: bool = False

    def to_json(self) -> dict[str, Any]:
        return dict(self.__dict__)


def _require_run(store: Store, run: str) -> None:
    keys.validate_run(run)
    if Manifest.load(store, run) is None and not store.exists(keys.claim_key(run)):
        raise InputError(f"no run {run!r} in {store.url}")


def cancel_run(store: Store, client: redis.Redis, run: str) -> CancelResult:
    """Cancel `run`: no batch of it starts again; running ones stop, checkpoint and park."""
    _require_run(store, run)
    result = CancelResult(run=run)
    from genfleet.producer.broker import purge_orders  # Celery: only when needed

    result.already = not Ledger(client).hold(run, time.time())
    for queue in _work_queues(client):
        removed = purge_orders(client, queue, run)
        result.orders_removed += len(removed)
        Ledger(client).unqueue(run, removed)
    result.running = sorted(running_batches(client, run))
    return result


@dataclass
class DeleteResult:
    run: str
    objects: int = 0
    redis_keys: int = 0
    orders_removed: int = 0

    def to_json(self) -> dict[str, Any]:
        return dict(self.__dict__)


def delete_run(
    settings: Settings,
    store: Store,
    client: redis.Redis,
    run: str,
    wait_s: float = 60.0,
    sleep: Callable[[float], None] = time.sleep,
) -> DeleteResult:
    """Remove `run` from the store and Redis, after its running batches stopped.

    Raises GenfleetError (the run stays cancelled, nothing deleted) when batches still run
    after `wait_s`: a batch finishing after the deletion would write into a deleted run.
    """
    from genfleet.producer.tries import read_rounds

    rounds = [round_.run for round_ in read_rounds(store, run)]
    try:  # a retry interrupted before its round was recorded
        following = keys.retry_run(run, len(rounds) + 1)
    except ValueError:  # a name too long for retry runs has none
        following = ""
    if following and store.exists(keys.claim_key(following)):
        rounds.append(following)
    for child in rounds:  # a round's answers are its run's: they go with it
        delete_run(settings, store, client, child, wait_s, sleep)
    cancelled = cancel_run(store, client, run)
    deadline = time.monotonic() + wait_s
    while running := running_batches(client, run):
        if time.monotonic() > deadline:
            raise GenfleetError(
                f"run {run!r}: {len(running)} batches still running after {wait_s:.0f} s "
                f"({', '.join(sorted(running)[:5])}); it is cancelled, nothing was deleted: "
                f"try `genfleet delete {run}` again when `genfleet status {run}` shows them "
                "stopped"
            )
        sleep(0.5)
    from genfleet.producer.broker import purge_orders  # Celery: only when needed

    result = DeleteResult(run=run, orders_removed=cancelled.orders_removed)
    # The tombstone first: from now on a stray order of this run's staging is dropped by
    # workers. It names the staging, not a time (that would compare this host's clock with
    # the workers'); a late batch that got past it still finds the claim gone (or another
    # staging's) before it writes anything, and drops itself.
    staging = current_staging(store, run) or ""
    client.set(keys.deleted_key(run), staging, ex=settings.visibility_timeout_s)
    for queue in _work_queues(client):
        result.orders_removed += len(purge_orders(client, queue, run, unacked=True))
    result.redis_keys = _delete_redis(client, run)
    result.objects = store.delete_prefix(f"{run}/")
    return result


def _delete_redis(client: redis.Redis, run: str) -> int:
    """Every Redis key of `run` (counters, sets, leases, task results, the cancelled flag)."""
    count = 0
    patterns = (
        keys.run_keys_pattern(run),
        keys.leases_pattern(run),
        f"celery-task-meta-{run}.batch-*",
    )
    for pattern in patterns:
        batch: list[bytes] = []
        for key in client.scan_iter(match=pattern, count=500):
            batch.append(key)
            if len(batch) >= 500:
                count += int(client.delete(*batch))
                batch = []
        if batch:
            count += int(client.delete(*batch))
    count += Ledger(client).forget_running(run)
    count += run_registry.retire(client, run)
    return count


def describe(store: Store, client: redis.Redis, run: str) -> str:
    """What `delete` would remove, for its confirmation question."""
    _require_run(store, run)
    manifest = Manifest.load(store, run)
    outputs = len(list(store.list(keys.outputs_prefix(run))))
    what = f"run {run!r} in {store.url}"
    if manifest is not None:
        what += (
            f" ({manifest.prompts_total} prompts, {outputs}/{manifest.batches_total} batches "
            f"done, model {manifest.model})"
        )
    return what
