"""When an engine death sends a worker's running batches back to the queue (`workers.hand_back`)."""

from __future__ import annotations

import pytest

from genfleet.workers.hand_back import HandBack, hands_back


@pytest.mark.parametrize(
    ("orders_waiting", "held", "start_s", "expected"),
    [
        (0, 120, 240.0, True),  # the run's last batches: another worker has room
        (0, 1, 30.0, True),
        (3, 120, 240.0, False),  # orders wait: every worker is full, moving them gains nothing
        (0, 0, 240.0, False),  # nothing held: nothing to hand back, keep taking orders
        (None, 120, 240.0, False),  # the queue not read: the batches stay, as they always did
        (0, 120, 2.0, False),  # a start of seconds: the move costs more than the wait
        (0, 120, None, False),  # no start that served is known
    ],
)
def test_a_death_hands_back_only_with_no_order_waiting_and_a_long_start(
    orders_waiting: int | None, held: int, start_s: float | None, expected: bool
) -> None:
    assert hands_back(orders_waiting, held, start_s, min_start_s=30.0) is expected


@pytest.mark.parametrize(
    ("engine_ready", "settled", "goes"),
    [
        (False, True, True),
        (False, False, False),  # a prompt the death cut is still judged: its evidence first
        (True, True, False),  # back before the batch's tick: it stays
    ],
)
def test_a_batch_goes_back_while_the_engine_restarts_once_its_prompts_are_judged(
    engine_ready: bool, settled: bool, goes: bool
) -> None:
    hand_back = HandBack(min_start_s=30.0)
    assert hand_back.died(orders_waiting=0, held=40, start_s=240.0)
    why = hand_back.why(engine_ready=engine_ready, settled=settled)
    assert (why is not None) is goes
    if goes:
        assert why is not None and "40 prompts" in why


def test_the_engine_back_ends_the_hand_back_and_only_a_hand_back_resumes_taking_orders() -> None:
    hand_back = HandBack(min_start_s=30.0)
    assert not hand_back.died(orders_waiting=5, held=40, start_s=240.0)
    assert hand_back.why(engine_ready=False, settled=True) is None
    assert not hand_back.restarted()  # it never stopped taking orders: nothing to resume

    assert hand_back.died(orders_waiting=0, held=40, start_s=240.0)
    assert hand_back.restarted()
    assert hand_back.why(engine_ready=False, settled=True) is None  # the next death decides anew
    assert not hand_back.restarted()
