"""A lost worker's answers go on from the batch's journal in Redis, on real SGLang, on a GPU.

Deselected by default (`-m gpu`), never in CI; needs what tests/workers/test_real_sglang_gpu.py
needs (its own module: one engine on the card at a time).

    python3 -m pytest -q -m gpu tests/workers/test_real_sglang_journal_gpu.py

The stack copies answers in flight to the store only every 600 s: nothing reaches the next
worker but what the journal kept (every 0.5 s) of each answer's streamed ids.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from genfleet.common import keys
from tests.support.real_sglang import MODELS, Stack, lose_worker, missing, worker_stack

Q35_NOMTP = MODELS / "q35_nomtp"

if (_why := missing((Q35_NOMTP,))) is not None:
    pytest.skip(f"real SGLang tests: {_why}", allow_module_level=True)

pytestmark = [pytest.mark.gpu, pytest.mark.integration, pytest.mark.slow]

BUDGET = 4096
PROMPTS = 96


@pytest.fixture(scope="module")
def journal_stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    with worker_stack(
        tmp_path_factory.mktemp("journal"),
        Q35_NOMTP,
        "gpu0@journal",
        30220,
        GENFLEET_MTP="false",
        GENFLEET_CHECKPOINT_INTERVAL_S="600",
        GENFLEET_INFLIGHT_JOURNAL_INTERVAL_S="0.5",
        GENFLEET_LEASE_TTL_S="20",
        GENFLEET_REAPER_INTERVAL_S="5",
    ) as stack:
        yield stack


def test_answers_of_a_lost_worker_go_on_from_its_journal(
    journal_stack: Stack, tmp_path: Path
) -> None:
    """SIGKILLed 2 s after its requests run (random weights: most answers stop early, so the
    kill comes soon), the worker has written no copy of its answers in flight."""
    ids = journal_stack.run("journal", PROMPTS, tmp_path, BUDGET, temperature=0.0)
    rows = lose_worker(
        journal_stack, "journal", ids, tmp_path / "worker2.log", "gpu0b@j", 420, drawing_s=2.0
    )
    resumed = sorted(r["resumed_tokens"] for r in rows.values() if r.get("resumed_tokens"))
    figures = {"resumed": len(resumed), "tokens": resumed}
    out = Path(os.environ.get("GENFLEET_GPU_OUT", "/tmp"))
    (out / "resume_journal.json").write_text(json.dumps(figures))
    print("RESUME_JOURNAL", json.dumps(figures))
    assert len(resumed) >= 8, figures  # answers in flight at the kill
    assert resumed[len(resumed) // 2] >= 50, figures  # 2 s of drawing, from no copy
    for row in rows.values():  # the budget carried: drawn before + after, never more
        tokens = row["usage"]["completion_tokens"]
        assert tokens == BUDGET if row["finish_reason"] == "length" else tokens < BUDGET
    assert not journal_stack.client.keys(keys.drawn_journal_tries_key("journal", "*"))
