"""Which messages a lost broker connection moves to the next one (`workers/process/reconnect`).

A task that ended just before the connection was lost has its ack queued on the consumer's
event loop, not done. The loop runs it after the reconnect; on the old channel, whose
connection is gone, kombu raised `'NoneType' object has no attribute 'client'` and the worker
ended (the chaos soak's control worker, at a Redis restart). `queued_on` names those messages
so that they move to the new channel with the running tasks' ones."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
from kombu.message import Message

from genfleet.workers.process.reconnect import queued_on

OLD, NEW = object(), object()


def request(channel: Any, state: str = "RECEIVED") -> Any:
    message = Message(body=b"{}", channel=channel, delivery_tag="tag")
    message._state = state
    return SimpleNamespace(message=message)


@pytest.mark.parametrize(
    ("held", "moved"),
    [
        (request(OLD), True),  # its ack waits on the loop, on the channel being lost
        (request(OLD, "ACK"), False),  # kombu acked it before the loss
        (request(OLD, "REJECTED"), False),
        (request(OLD, "REQUEUED"), False),
        (request(NEW), False),  # already on another channel
        (SimpleNamespace(message=None), False),
    ],
)
def test_a_queued_ack_not_yet_done_moves_with_the_connection(held: Any, moved: bool) -> None:
    assert (queued_on(OLD, [held]) == [held]) is moved


def test_every_task_of_the_worker_app_acks_on_the_new_channel_after_a_blip() -> None:
    """Only a `HeldRequest` has its ack moved to the new channel: the progress repair's was a
    plain request, and when it ended while Redis restarted its queued ack ran on the old
    channel and ended the control worker (the chaos bench's, with its reaper)."""
    import genfleet.workers.control.beat  # noqa: F401 - registers the beat tasks
    import genfleet.workers.tasks  # noqa: F401 - registers the generate task
    from genfleet.workers.app import app
    from genfleet.workers.process.reconnect import HeldRequest

    ours = {name: task for name, task in app.tasks.items() if name.startswith("genfleet.")}
    assert len(ours) >= 4
    plain = [n for n, t in ours.items() if not issubclass(t.Request, HeldRequest)]
    assert plain == []
