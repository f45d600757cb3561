from __future__ import annotations

import pytest

from genfleet.common import keys


@pytest.mark.parametrize(
    "run",
    ["a", "run-1", "Qwen3.6_27B.v2", "x" * 128, "2026-11-29"],
)
def test_valid_run_names(run: str) -> None:
    assert keys.validate_run(run) == run


@pytest.mark.parametrize(
    ("run", "reason"),
    [
        ("", "empty"),
        ("../etc", "not allowed"),
        ("a/b", "not allowed"),
        ("a..b", "not allowed"),
        (".hidden", "not allowed"),
        ("run:inject", "not allowed"),
        ("run*", "not allowed"),
        ("x" * 129, "not allowed"),
        ("a b", "not allowed"),
    ],
)
def test_bad_run_names_say_why(run: str, reason: str) -> None:
    with pytest.raises(ValueError, match=reason):
        keys.validate_run(run)


def test_batch_ids_sort_in_input_order() -> None:
    ids = [keys.batch_id(i) for i in (0, 9, 10, 99, 100, 123456)]
    assert ids == sorted(ids)
    assert keys.batch_index(keys.batch_id(42)) == 42
    assert keys.batch_from_output_key(keys.output_key("r", "batch-000042")) == "batch-000042"
    with pytest.raises(ValueError):
        keys.validate_batch("batch-1/../x")
