"""Which queue a work order travels on.

A run is for one model, every work order names it, and a worker consumes only its model's
queue: the producer (which routes) and the workers (which take and hand back orders) agree
by construction.

    model_ref(Settings())                           # ModelRef("emulator", "emulator")
    model_ref(Settings(model="/models/Qwen3.6-27B"))  # ModelRef("sglang", "/models/Qwen3.6-27B")
    work_queue("gpu", ModelRef("emulator", "emulator"))           # "gpu.emulator"
    work_queue("gpu", ModelRef("sglang", "qwen3"))                # "gpu.qwen3"
    work_queue("gpu", ModelRef("sglang", "/models/Qwen3.6-27B"))  # "gpu.Qwen3.6-27B-<hash8>"
"""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass
from typing import Any

from genfleet.common.settings import Settings

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
