"""The Celery configuration every genfleet process shares: workers, beat, Flower and the CLI.

A plain dict so `common` never imports Celery. The visibility timeout must be the same
everywhere: on Redis the shortest one among the connected processes wins, and a late-acked task
still running after it is delivered again in parallel (kombu QoS.restore_visible, celery#5935).
"""

from __future__ import annotations

from typing import Any

from genfleet.common.settings import Settings

GENERATE_TASK = "genfleet.generate_batch"
POWER_WATCH_TASK = "genfleet.power_watch"
REAPER_TASK = "genfleet.reap_leases"
RECONCILE_TASK = "genfleet.reconcile_progress"

# How long the result backend keeps a beat task's result (power-watch, reaper, reconcile):
# Flower's task list shows each round from its events, and its API and a person's
# `celery result` read the last hour's; a round a minute kept the week batch results are
# would be 10,000 power-watch results of a row per GPU.
BEAT_RESULT_EXPIRES_S = 3600
# The same for an order a worker handed back because it does not serve the run's model: while
# no worker serves a run, each of its refusing workers' batch slots hands one back per rest
# (workers/admission.py), thousands a day that say nothing after the hour.
HANDED_BACK_RESULT_EXPIRES_S = 3600


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
        # A broker blip costs nothing already done: running batches keep running across the
        # reconnect and ack on the new connection (genfleet's consumer, workers/process/reconnect).
        "worker_cancel_long_running_tasks_on_connection_loss": False,
        "worker_consumer": "genfleet.workers.process.reconnect:Consumer",
        "worker_enable_soft_shutdown_on_idle": True,
        # A cold shutdown (SIGQUIT, a second Ctrl-C) also gives running batches the grace
        # period, then the pool cancels them: they checkpoint and go back to the queue.
        "worker_soft_shutdown_timeout": settings.shutdown_grace_s,
        # Threads: several batches share one asyncio loop and one in-flight limiter; the main
        # thread stays free for heartbeats and control commands (a solo worker looks dead).
        # genfleet's subclass can also stop running batches on a cold shutdown.
        "worker_pool": "genfleet.workers.process.pool:TaskPool",
        "worker_concurrency": settings.worker_concurrency,
        # Work orders are sent to their model's queue (`{queue}.emulator`, `{queue}.<model>`,
        # see below), always named explicitly: nothing is routed here.
        "task_default_queue": settings.queue,
        "task_routes": {},
        "task_track_started": True,
        "task_send_sent_event": True,
        "worker_send_task_events": True,
        # A batch's result (one per batch: its task id is run.batch), for a week; a beat
        # task's for BEAT_RESULT_EXPIRES_S (workers/context.BeatTask).
        "result_expires": 7 * 24 * 3600,
        "result_extended": True,
        "worker_hijack_root_logger": False,
        "broker_heartbeat": 0,
        "timezone": "UTC",
    }
