"""The control worker's reconcile pass: every known run's progress copy repaired from the
store, and complete runs retired from the registry the power-watch and `top` read.

Its pieces are common/progress.py's (the copy) and the ledger's (a failed batch whose output
exists is done; whether orders are outstanding); the beat task is workers/tasks.py's
`reconcile_progress`.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import redis

from genfleet.common import keys, progress, run_registry
from genfleet.common.errors import GenfleetError
from genfleet.common.ledger import Ledger
from genfleet.common.store import Store

log = logging.getLogger("genfleet.reconcile")


@dataclass
class Pass:
    """What one reconcile pass did: the repairs that changed something, and the runs it took
    out of the registry (common/run_registry.py) because they are complete."""

    repairs: list[progress.Repair] = field(default_factory=list)
    retired: list[str] = field(default_factory=list)
    failed: list[str] = field(default_factory=list)  # runs that could not be read: next pass


def reconcile_runs(store: Store, client: redis.Redis, now: float | None = None) -> Pass:
    """One background pass (the control worker's beat) over the registry of runs.

    A run whose copy is incomplete is reconciled from its listing (a running run costs one
    listing per pass). A complete one (verified complete by an earlier pass, nothing queued,
    not staging) leaves the registry, which the power-watch and `top` read every round: a
    registry that only grew would cost them more each week. Enqueueing the run again (retry,
    resume) puts it back; `genfleet runs` lists runs from the store, not from here."""
    done = Pass()
    ledger = Ledger(client)
    for run in run_registry.runs(client):
        snap = progress.snapshot(client, run)
        if snap is not None and snap.batches_done >= int(snap.summary["batches_total"]):
            if not ledger.queued_count(run) and not client.exists(keys.staging_key(run)):
                run_registry.retire(client, run)
                done.retired.append(run)
            continue
        try:
            repair = repair_run(store, client, run, now, ledger)
        except (GenfleetError, ValueError) as exc:  # one run's bad manifest or store
            log.warning("progress of %s not reconciled: %s", run, exc)
            done.failed.append(run)
            continue
        if repair is not None and repair.changed:
            done.repairs.append(repair)
    return done


def repair_run(
    store: Store,
    client: redis.Redis,
    run: str,
    now: float | None = None,
    ledger: Ledger | None = None,
) -> progress.Repair | None:
    """One run's progress copy repaired from its listing (O(batches)); None when it has no
    manifest yet (staging). Also the reaper's, at once, for a batch whose worker wrote its
    output and was lost before counting it: the run reads done then, not a pass later."""
    found = progress.verify(store, client, run, now)
    if found is None:
        return None
    found.repair.unfailed = (ledger or Ledger(client)).unfail_done(run, found.listed)
    return found.repair
