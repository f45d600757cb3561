"""What an engine death means for one prompt that was sent into it: pure, table-tested
(`tests/workers/test_blame.py`); the feeder gathers the facts and acts on the verdict.

A prompt that kills its engine does so as it arrives (its prefill, its first steps): the
death is its own whenever its request was written (reached) and the engine died before its
answer began, whatever the exit code and whatever the client saw of the socket (a reset, a
close before or after the answer's headers, an event with no text yet). Two deaths of the
engine's own making with it arriving, the last with no other prompt arriving beside it,
blame it, on one worker or across several (the counts of earlier workers come with the
batch: `workers/crash_evidence`). A death the engine did not make itself (a kill from
outside, the watchdog's) is no prompt's: each prompt it cut goes back at once, as one past
its arrival does, and nothing is counted against it.

    judge(Death(reached=True, died=True, begun=False, own=True, alone=True), crashes_before=1)
    # Verdict.BLAME
    judge(Death(reached=True, died=True, begun=True, own=True, alone=True), crashes_before=3)
    # Verdict.PAST_ARRIVAL: its answer had begun, it did not kill the engine
"""

from __future__ import annotations

import enum
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Death:
    """One failed send of a prompt, against the engine's deaths.

    `reached`: its request was written (not a connection that never opened); `died`: the
    engine died (its supervisor counted the exit) while it was in flight; `begun`: its answer
    had begun (output text streamed); `own`: the exit was the engine's own (`crashes.is_crash`:
    not a kill from outside, not the watchdog's); `alone`: it was the only prompt arriving in
    the engine from its send to the death (no other suspect in flight, nothing sent beside it).
    """

    reached: bool
    died: bool
    begun: bool
    own: bool
    alone: bool


class Verdict(enum.Enum):
    NOT_IN_IT = "not_in_it"  # never in flight at a death: sent again, nothing counted
    PAST_ARRIVAL = "past_arrival"  # its answer had begun: not the cause; back at once
    # the engine was killed (from outside, by the watchdog): no prompt's doing; back at once,
    # nothing counted (a restart of a killed engine keeps whatever its counts said before)
    KILLED = "killed"
    SUSPECT = "suspect"  # a death counted against it: back through the suspect lane
    BLAME = "blame"  # its error record (`engine_crash`), once the engine serves others


def judge(death: Death, crashes_before: int) -> Verdict:
    """The verdict on a prompt for one failed send; `crashes_before`: the engine's own deaths
    it was arriving at before this one, on this worker and the ones before."""
    if not (death.reached and death.died):
        return Verdict.NOT_IN_IT
    if death.begun:
        return Verdict.PAST_ARRIVAL
    if not death.own:
        return Verdict.KILLED
    if death.alone and crashes_before >= 1:
        return Verdict.BLAME
    return Verdict.SUSPECT


def goes_alone(crashes: int) -> bool:
    """Whether a suspect goes back alone (the lane's solo: nothing else sent until its answer
    begins): after two of the engine's own deaths with it arriving, counting earlier workers'
    (one more alone blames it). Kills count toward nothing: an engine killed from outside
    every few minutes (preemption, an operator, a chaos run) would otherwise send each prompt
    it held back one at a time."""
    return crashes >= 2
