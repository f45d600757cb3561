"""The producer's side of Celery: a client app that sends work orders by task name.

The producer never imports `workers`: it names the task (`genfleet.generate_batch`) and sends
JSON, so a producer-only install needs neither SGLang nor NVML.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterable
from typing import Any

from celery import Celery

from common.celery_config import GENERATE_TASK, celery_config
from common.records import WorkOrder
from common.settings import Settings


def make_client_app(settings: Settings) -> Celery:
    app = Celery("genfleet-producer")
    app.conf.update(celery_config(settings))
    return app


def send_orders(app: Celery, settings: Settings, orders: Iterable[WorkOrder]) -> int:
    """Send work orders to the GPU queue over one connection; returns how many were sent."""
    sent = 0
    with app.producer_or_acquire() as producer:
        for order in orders:
            body: dict[str, Any] = order.model_dump()
            app.send_task(
                GENERATE_TASK,
                kwargs={"order": body},
                queue=settings.queue,
                task_id=f"{order.run}.{order.batch}.{uuid.uuid4().hex[:8]}",
                producer=producer,
            )
            sent += 1
    return sent
