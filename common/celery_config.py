"""The Celery configuration every genfleet process shares: workers, beat, Flower and the CLI.

A plain dict so `common` never imports Celery. The visibility timeout must be the same
everywhere: on Redis the shortest one among the connected processes wins, and a late-acked task
still running after it is delivered again in parallel (kombu QoS.restore_visible, celery#5935).
"""

from __future__ import annotations

import base64
import hashlib
import re
from dataclasses import dataclass
from typing import Any

import orjson

from genfleet.common.settings import Settings

GENERATE_TASK = "genfleet.generate_batch"
POWER_WATCH_TASK = "genfleet.power_watch"
REAPER_TASK = "genfleet.reap_leases"


def celery_config(settings: Settings) -> dict[str, Any]:
    broker = settings.redis_url.get_secret_value()
    transport = {"visibility_timeout": settings.visibility_timeout_s}
    return {
        "broker_url": broker,
        "result_backend": broker,
        "broker_transport_options": transport,
        "result_backend_transport_options": transport,
        "broker_connection_retry_on_startup": True,
        # JSON only: a pickled message is refused, never executed.
        "task_serializer": "json",
        "result_serializer": "json",
        "accept_content": ["json"],
        "result_accept_content": ["json"],
        # Nothing lost: ack after the batch's output is in the store; one message at a time.
        "task_acks_late": True,
        "task_reject_on_worker_lost": True,
        "worker_prefetch_multiplier": 1,
        "worker_cancel_long_running_tasks_on_connection_loss": True,
        "worker_enable_soft_shutdown_on_idle": True,
        # A cold shutdown (SIGQUIT, a second Ctrl-C) also gives running batches the grace
        # period, then the pool cancels them: they checkpoint and go back to the queue.
        "worker_soft_shutdown_timeout": settings.shutdown_grace_s,
        # Threads: several batches share one asyncio loop and one in-flight limiter; the main
        # thread stays free for heartbeats and control commands (a solo worker looks dead).
        # genfleet's subclass can also stop running batches on a cold shutdown.
        "worker_pool": "genfleet.workers.pool:TaskPool",
        "worker_concurrency": settings.worker_concurrency,
        # Work orders are sent to their model's queue (`{queue}.emulator`, `{queue}.<model>`,
        # see below), always named explicitly: nothing is routed here.
        "task_default_queue": settings.queue,
        "task_routes": {},
        "task_track_started": True,
        "task_send_sent_event": True,
        "worker_send_task_events": True,
        "result_expires": 7 * 24 * 3600,
        "result_extended": True,
        "worker_hijack_root_logger": False,
        "broker_heartbeat": 0,
        "timezone": "UTC",
    }


# --- which queue a work order travels on ----------------------------------------------------
#
# A run is for one model, every work order names it, and a worker consumes only its model's
# queue: the producer (which routes) and the workers (which take and hand back orders) agree
# by construction.
#
#     model_ref(Settings())                           # ModelRef("emulator", "emulator")
#     model_ref(Settings(model="/models/Qwen3.6-27B"))  # ModelRef("sglang", "/models/Qwen3.6-27B")
#     work_queue("gpu", ModelRef("emulator", "emulator"))           # "gpu.emulator"
#     work_queue("gpu", ModelRef("sglang", "qwen3"))                # "gpu.qwen3"
#     work_queue("gpu", ModelRef("sglang", "/models/Qwen3.6-27B"))  # "gpu.Qwen3.6-27B-<hash8>"

EMULATOR = "emulator"
_SLUG_BAD = re.compile(r"[^A-Za-z0-9._-]+")


@dataclass(frozen=True, slots=True)
class ModelRef:
    """The engine kind and the model it serves: a served name, a path, or (for an external or
    command engine with no model named) the endpoint or command itself."""

    engine: str
    model: str


def model_ref(settings: Settings) -> ModelRef:
    """The model a process with these settings serves (a worker) or targets (the producer).

    The emulator is one model of its own, whatever `--model` says: its outputs are synthetic
    and must never share a run or a queue with a real model's.
    """
    kind = settings.engine_kind
    if kind == EMULATOR:
        return ModelRef(EMULATOR, EMULATOR)
    name = settings.served_model_name or settings.model
    if name:
        return ModelRef(kind, name)
    if kind == "external" and settings.engine_url:
        return ModelRef(kind, settings.engine_url.rstrip("/"))
    return ModelRef(kind, settings.engine_command or kind)


def queue_slug(model: str) -> str:
    """A readable, unique queue suffix for `model`: the name itself when it is already safe,
    else its last path part made safe plus a short hash of the whole name, so that
    `/a/Qwen` and `/b/Qwen` never share a queue."""
    if _SLUG_BAD.search(model) is None and model != EMULATOR and model not in {".", ".."}:
        return model
    tail = model.rstrip("/").rsplit("/", 1)[-1] or "model"
    readable = _SLUG_BAD.sub("-", tail).strip("-.") or "model"
    digest = hashlib.sha256(model.encode()).hexdigest()[:8]
    return f"{readable[:60]}-{digest}"


def work_queue(prefix: str, ref: ModelRef) -> str:
    """The Celery queue of `ref`'s work orders: `gpu.emulator`, `gpu.<model-slug>`."""
    if ref.engine == EMULATOR:
        return f"{prefix}.{EMULATOR}"
    return f"{prefix}.{queue_slug(ref.model)}"


def worker_queue(settings: Settings) -> str:
    """The one queue a GPU worker with these settings consumes."""
    return work_queue(settings.queue, model_ref(settings))


def order_queue(prefix: str, order: dict[str, Any]) -> str:
    """The queue a work order (as its JSON dict) belongs on."""
    return work_queue(prefix, ModelRef(str(order["engine"]), str(order["model"])))


def work_order_of(message: bytes | str) -> tuple[str, str] | None:
    """(run, batch) of a raw kombu message on Redis if it is a genfleet work order."""
    try:
        data = orjson.loads(message)
        if data.get("headers", {}).get("task") != GENERATE_TASK:
            return None
        body = data["body"]
        if data.get("properties", {}).get("body_encoding") == "base64":
            body = base64.b64decode(body)
        order = orjson.loads(body)[1]["order"]
        return str(order["run"]), str(order["batch"])
    except (ValueError, KeyError, IndexError, TypeError, AttributeError):
        return None
