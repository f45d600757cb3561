"""What an engine death means for a prompt sent into it (`workers/feeding/blame`): pure,
table-tested."""

from __future__ import annotations

import pytest

from genfleet.workers.feeding.blame import Death, Verdict, goes_alone, judge

B, S, P, N, K = (
    Verdict.BLAME,
    Verdict.SUSPECT,
    Verdict.PAST_ARRIVAL,
    Verdict.NOT_IN_IT,
    Verdict.KILLED,
)


@pytest.mark.parametrize(
    ("reached", "died", "begun", "own", "alone", "crashes_before", "verdict"),
    [
        # written, the engine died before its answer began, its own exit, alone: the second
        # such death blames it, whatever the socket showed and whichever worker saw the first
        (True, True, False, True, True, 1, B),
        (True, True, False, True, True, 3, B),
        (True, True, False, True, True, 0, S),  # the first death alone: not yet
        (True, True, False, True, False, 1, S),  # another prompt arriving beside it
        (True, True, False, True, False, 5, S),
        (True, True, False, False, True, 1, K),  # a kill from outside or the watchdog's
        (True, True, False, False, False, 0, K),  # arriving beside others, at a kill
        (True, True, True, True, True, 1, P),  # its answer had begun: past its arrival
        (True, True, True, False, False, 0, P),
        (False, True, False, True, True, 1, N),  # never connected: never in flight
        (True, False, False, True, True, 1, N),  # a reset with no death: nobody's crash
        (False, False, False, False, False, 0, N),
    ],
)
def test_a_prompt_is_blamed_for_a_second_own_death_it_arrived_at_alone(
    reached: bool,
    died: bool,
    begun: bool,
    own: bool,
    alone: bool,
    crashes_before: int,
    verdict: Verdict,
) -> None:
    death = Death(reached=reached, died=died, begun=begun, own=own, alone=alone)
    assert judge(death, crashes_before) is verdict


@pytest.mark.parametrize(
    ("crashes", "alone"),
    [
        (0, False),
        (1, False),  # one of the engine's own deaths: through the lane with others
        (2, True),  # two, on this worker or earlier ones: alone
        (5, True),
    ],
)
def test_a_suspect_goes_alone_after_two_of_the_engines_own_deaths(
    crashes: int, alone: bool
) -> None:
    assert goes_alone(crashes) is alone
