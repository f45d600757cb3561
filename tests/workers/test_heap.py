"""A worker settles its start-up heap: what start-up built leaves the collector's walks, what
the work builds later is collected as before."""

from __future__ import annotations

import gc
import weakref

from genfleet.workers.process import heap


class Node:
    def __init__(self) -> None:
        self.me = self  # a reference cycle: only the cyclic collector frees it


def tracked(obj: object) -> bool:
    """Whether the collector's generations (not the frozen one) hold `obj`."""
    return any(o is obj for o in gc.get_objects())


def test_settle_freezes_start_up_and_leaves_later_garbage_to_the_collector() -> None:
    built_at_start = Node()
    try:
        frozen = heap.settle()
        assert frozen == gc.get_freeze_count() > 0
        assert not tracked(built_at_start)  # never walked again

        later = Node()
        gone = weakref.ref(later)
        assert tracked(later)
        del later
        gc.collect()
        assert gone() is None  # a cycle made after start-up is still collected
    finally:
        gc.unfreeze()
