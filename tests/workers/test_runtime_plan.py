"""What a worker tells the power-watch of its engine plan (`WorkerRuntime.engine_state`): the
plan's cap beside the engine's, and the plan's flags as the fix only for an engine that was
launched otherwise (an external one); one launched with them that runs below the plan's cap
cut it, and the limit's own fix stands."""

from __future__ import annotations

from pathlib import Path

import pytest

from genfleet.common.settings import Settings
from genfleet.workers.engine.plan import EnginePlan
from genfleet.workers.runtime import WorkerRuntime

PLAN = EnginePlan(True, 98, False)


@pytest.mark.parametrize(
    ("launched", "reference", "expected"),
    [
        (PLAN, None, (98, None, True)),  # launched with the plan: a cut is no flag's fault
        (None, PLAN, (98, PLAN.fix, True)),  # an external engine: the plan is the fix
        (EnginePlan(False, 256, True), None, (None, None, False)),  # nothing planned
        (None, None, (None, None, False)),
    ],
)
def test_the_plan_beside_the_engine(
    redis_url: str,
    tmp_path: Path,
    launched: EnginePlan | None,
    reference: EnginePlan | None,
    expected: tuple[int | None, str | None, bool],
) -> None:
    settings = Settings(redis_url=redis_url, store=f"file://{tmp_path}")
    runtime = WorkerRuntime(settings, "gpu0@test")
    runtime.plan, runtime.reference_plan = launched, reference
    state = runtime.engine_state()
    assert (state.plan_cap, state.plan_fix, state.mtp_planned_off) == expected
