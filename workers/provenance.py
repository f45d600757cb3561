"""Whether a work order is still the run's, and whether its staged input is what it names.

An order binds itself to one staging of one run (`WorkOrder.staging`, `input_sha256`). Checked
where the order is admitted (`workers.admission.admit`, before the claim) and again before
every write into the run (a checkpoint part: `workers.checkpoint.save`; the output:
`workers.batch`), because a run can be deleted, and staged anew under its name, while one of
its batches waits in a worker's prefetch or runs:

- the run's claim names another staging (or the run has no claim any more): the order is
  superseded (`BatchSuperseded`): acknowledged, never generated, nothing written;
- the staged input's content is not the order's (`BatchInputMismatch`): the batch is failed
  with that reason, never generated from prompts it was not issued for;
- a checkpoint row stands as a prompt's result only when it names that staged prompt's digest
  (`workers.checkpoint.kept_parts`): a checkpoint of other prompts under the same (id,
  sample) is done again.

Orders of an older genfleet carry neither field and are not checked.

The model is part of what an order asks: the run's, recorded at staging, is judged against
the worker's where the order is admitted (`common.model_identity`, `workers.admission`);
`thinking_refusal` refuses `--no-thinking` on a model without a switch.
"""

from __future__ import annotations

import gzip
from dataclasses import dataclass
from typing import Any

import orjson

from genfleet.common.errors import BatchInputMismatch, BatchSuperseded
from genfleet.common.manifest import current_staging
from genfleet.common.records import PromptRecord, WorkOrder, batch_digest, line_digests
from genfleet.common.store import Store


@dataclass(frozen=True, slots=True)
class StagedInput:
    """A batch's staged prompts and each one's line digest, in input order."""

    records: list[PromptRecord]
    digests: list[str]

    def digest_of(self) -> dict[tuple[str, int], str]:
        pairs = zip(self.records, self.digests, strict=True)
        return {record.key: digest for record, digest in pairs}


def ensure_current(store: Store, order: WorkOrder) -> None:
    """Raise BatchSuperseded unless the run's claim still names the order's staging."""
    if not order.staging:
        return
    current = current_staging(store, order.run)
    if current != order.staging:
        now = "the run was deleted" if current is None else "the run was staged again since"
        raise BatchSuperseded(
            f"{order.run}/{order.batch} is an order of staging {order.staging[:12]}, which the "
            f"run no longer has ({now}): dropped, not generated"
        )


def read_staged(order: WorkOrder, data: bytes) -> StagedInput:
    """Decode a staged input, refusing one whose content is not the order's."""
    raw = gzip.decompress(data)
    digests = line_digests(raw)
    if order.input_sha256 and batch_digest(digests) != order.input_sha256:
        raise BatchInputMismatch(
            f"staged input {order.key} is not the one {order.run}/{order.batch} was issued for "
            f"(content {batch_digest(digests)[:12]}, the order names "
            f"{order.input_sha256[:12]}): not generated"
        )
    lines = [line for line in raw.splitlines() if line.strip()]
    records = [PromptRecord.from_json(orjson.loads(line)) for line in lines]
    return StagedInput(records, digests)


def thinking_refusal(order: WorkOrder, identity: dict[str, Any]) -> str | None:
    """`--no-thinking` where the model has no thinking switch cannot be honoured."""
    if order.params.thinking or identity.get("thinking_switch"):
        return None
    return (
        f"{order.run}/{order.batch} asks for no thinking (--no-thinking), but the model has no "
        f"thinking switch (reasoning parser {identity.get('reasoning_parser')!r}; "
        f"--thinking-switch none or a family without one, such as DeepSeek-R1): refused, not "
        f"ignored. Stage the run with thinking on, or name the switch (--thinking-switch KEY)"
    )
