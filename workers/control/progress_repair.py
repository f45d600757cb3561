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
            found = progress.verify(store, client, run, now)
        except (GenfleetError, ValueError) as exc:  # one run's bad manifest or store
            log.warning("progress of %s not reconciled: %s", run, exc)
            done.failed.append(run)
            continue
        if found is None:
            continue  # no manifest yet: staging
        found.repair.unfailed = ledger.unfail_done(run, found.listed)
        if found.repair.changed:
            done.repairs.append(found.repair)
    return done
