"""A hand-back the broker refuses: an order for another model reaches a worker, which hands it
back to its own queue; when the broker will not take it (kombu's OperationalError), the
order is put back where it came from instead of acked, and once the broker takes hand-backs
again it lands on its model's queue. Nothing is generated and nothing is lost.

The broker refuses through a real Redis ACL: the worker's user may write its own queue and
Celery's keys, not the other model's queue, so kombu's publish fails (and Celery's retries of
it) while the worker consumes and requeues as usual.
"""

from __future__ import annotations

import base64
from collections.abc import Callable
from pathlib import Path

import orjson
import pytest

from genfleet.common import keys
from genfleet.common.celery_config import GENERATE_TASK
from genfleet.common.store import open_store
from genfleet.producer.broker import orders_in_broker
from harness.control import control_app
from harness.env import base_env
from harness.processes import Worker
from harness.runs import stage_other_model_run
from harness.services import RedisServer
from harness.waits import wait_for

pytestmark = [pytest.mark.fault, pytest.mark.integration, pytest.mark.slow]

WORKER_USER, WORKER_PASSWORD = "emulator-worker", "worker-acl-pw"
# What a Celery worker of the emulator's queue writes: its queue, kombu's bindings and unacked
# hash, results, pidbox replies, genfleet's keys; Pub/Sub for events and control.
WORKER_KEYS = ["~gpu.emulator*", "~_kombu.*", "~unacked*", "~celery*", "~genfleet:*", "~*pidbox*"]


def test_a_hand_back_the_broker_refuses_puts_the_order_back_unacked(
    tmp_path: Path, private_redis: RedisServer, start_worker: Callable[..., Worker]
) -> None:
    admin = private_redis.client()
    rule = ["on", f">{WORKER_PASSWORD}", "&*", "+@all", *WORKER_KEYS]
    admin.acl_setuser(WORKER_USER, reset=True)
    admin.execute_command("ACL", "SETUSER", WORKER_USER, *rule)
    port = private_redis.port
    worker_url = f"redis://{WORKER_USER}:{WORKER_PASSWORD}@127.0.0.1:{port}/0"
    store_url = (tmp_path / "store").as_uri()
    worker = start_worker(base_env(worker_url, store_url, log_dir=tmp_path))

    # A model's run staged by its producer (the default user): its two orders wait on the
    # model's queue; one of them is sent to the emulator's queue as well (misdelivered).
    stage_other_model_run(private_redis.url, store_url, tmp_path)
    message = orjson.loads(admin.rpop("gpu.other-model") or b"{}")
    order = orjson.loads(base64.b64decode(message["body"]))[1]["order"]
    with control_app(private_redis.url) as app:
        app.send_task(GENERATE_TASK, kwargs={"order": order}, queue="gpu.emulator")
    worker.wait_ready()

    def put_back() -> bool:
        """The order was taken and requeued: back in the broker (on the emulator's queue, or
        delivered again), marked redelivered by kombu's requeue."""
        waiting = admin.lrange("gpu.emulator", 0, -1)
        delivered = [orjson.dumps(orjson.loads(raw)[0]) for raw in admin.hvals(keys.UNACKED)]
        return any(orjson.loads(raw)["headers"].get("redelivered") for raw in waiting + delivered)

    # The worker takes the order, cannot hand it back, and puts it back instead of acking it:
    # the order stays in the broker while the broker refuses.
    wait_for(put_back, 60, "the refused hand-back to put the order back", 0.1)
    assert orders_in_broker(admin, "gpu.emulator", "model-run") == {order["batch"]}
    assert admin.llen("gpu.other-model") == 1

    # The broker takes hand-backs again: the order lands on its model's queue.
    admin.execute_command("ACL", "SETUSER", WORKER_USER, "~gpu.other-model*")
    wait_for(lambda: admin.llen("gpu.other-model") == 2, 60, "the order handed back", 0.2)
    assert orders_in_broker(admin, "gpu.other-model", "model-run") == {
        keys.batch_id(0),
        keys.batch_id(1),
    }
    wait_for(
        lambda: not orders_in_broker(admin, "gpu.emulator", "model-run"),
        30,
        "no copy left on the emulator's queue",
        0.2,
    )
    store = open_store(store_url)
    assert list(store.list("model-run/outputs/")) == []
    assert list(store.list("model-run/parts/")) == []
    assert worker.proc.poll() is None
    admin.close()
