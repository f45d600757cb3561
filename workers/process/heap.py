"""The worker's heap, settled once start-up is done: what start-up built is left out of every
garbage collection from then on.

A worker's start-up builds hundreds of thousands of objects that live as long as the process
(Celery, kombu, boto3's service models, pydantic's schemas, the engine client), and CPython's
cyclic collector walks every one of them again on each full collection, which the allocations
of a few thousand answers a second set off again and again. `gc.freeze()` moves them to a
permanent generation the collector never walks (reference counting still frees what is
dropped); what the work builds later is collected as before. Measured on the client path
(`bench/client_overhead.py`, zero-time engine): the collector took about a quarter of the
worker's CPU per answer before.
"""

from __future__ import annotations

import gc


def settle() -> int:
    """Collect what start-up left as garbage, then freeze the rest; returns how many objects
    are frozen. Called once, when the worker is ready to consume."""
    gc.collect()
    gc.freeze()
    return gc.get_freeze_count()
