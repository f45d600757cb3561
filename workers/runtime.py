"""A worker's long-lived parts: its engine, its feeder, its store and Redis connections.

Built once per worker process by the engine bootstep before the worker consumes, torn down
when it stops. The bootstep attaches it to the worker and to the generate task's base class
(workers/context.py: the task sees it as a `TaskRuntime`).
"""

from __future__ import annotations

import logging
import socket
import time
from collections.abc import Callable
from functools import partial
from typing import Any

import orjson
import redis

from genfleet.common import engine_alarms, findings
from genfleet.common.queue_depth import queue_depth
from genfleet.common.redis_conn import connect
from genfleet.common.routing import worker_queue
from genfleet.common.settings import Settings
from genfleet.common.store import Store, store_of
from genfleet.workers.crash_evidence import CrashEvidence
from genfleet.workers.engine import local
from genfleet.workers.engine.crashes import CRASH_LOOP_REPEATS, budget_suggestion, loop_suggestion
from genfleet.workers.engine.families import choose
from genfleet.workers.engine.fingerprint import checkpoint_identity
from genfleet.workers.engine.plan import EnginePlan
from genfleet.workers.engine.plan import check as plan_check
from genfleet.workers.engine.sampling_defaults import read_sampling_defaults
from genfleet.workers.engine.supervisor import EngineSupervisor
from genfleet.workers.engine.watchdog import StallWatchdog
from genfleet.workers.feeding import (
    DeadlinePolicy,
    EngineClient,
    Feeder,
    NativeClient,
    ThinkingSwitch,
    default_max_inflight,
    draws_by_ids,
    engine_reasoning_parser,
    repetition_rule,
    splits_reasoning,
)
from genfleet.workers.hand_back import HandBack
from genfleet.workers.observe.engine_state import (
    EngineState,
    accept_length_from_server_info,
    enforced_cap,
)
from genfleet.workers.observe.live_progress import ProgressTally
from genfleet.workers.observe.liveness import Presence, connection_name
from genfleet.workers.observe.power_watch import fleet_state
from genfleet.workers.observe.sampler import Monitor, make_sampler
from genfleet.workers.process.slots import PrefetchSlots, room_left
from genfleet.workers.refusals import RunVerdicts

log = logging.getLogger("genfleet.worker")
# How long a written request that failed waits for its engine's exit to show while the process
# still runs (`Feeder.exit_grace_s`): an engine may close its connections a moment before it
# exits, and a death seen after the prompt was sent again would be counted against nobody.
EXIT_GRACE_S = 3.0


class WorkerRuntime:
    """Everything one worker owns. `start()` blocks until the engine serves."""

    def __init__(
        self,
        settings: Settings,
        hostname: str,
        on_exhausted: Callable[[str], None] | None = None,
        on_recovered: Callable[[], None] | None = None,
        on_pause: Callable[[str], None] | None = None,
        on_resume: Callable[[], None] | None = None,
    ) -> None:
        """`on_exhausted` / `on_recovered`: stop and start consuming around a spent restart
        budget's cool-down; `on_pause` / `on_resume`: around a restart whose batches are
        handed back (`workers.hand_back`)."""
        self.settings = settings
        self.hostname = hostname
        self.on_exhausted = on_exhausted
        self.on_recovered = on_recovered
        self.on_pause = on_pause
        self.on_resume = on_resume
        self.hand_back = HandBack(settings.hand_back_min_start_s)
        self.queue = worker_queue(settings)  # the one queue (model) this worker serves
        # Set once Celery consumes `queue` (worker_ready, after the engine is up): until then
        # the worker answers no broadcast, and its pushed summary says it is starting.
        self.consuming = False
        # Every store call ends well inside the lease it runs under (a hung put cannot outlast
        # it); the lease heartbeat has a client of its own whose calls end inside one beat.
        self.store: Store = store_of(settings, deadline_s=settings.lease_ttl_s / 2)
        self.redis: redis.Redis = connect(settings)
        self.lease_redis: redis.Redis = connect(
            settings, check=False, timeout_s=max(settings.lease_ttl_s / 4, 0.5)
        )
        # Its named connection, so that the reaper knows at once when it died (a lease lapses
        # a lease later): pinged as often as a lease is refreshed.
        self.presence = Presence(
            connect(
                settings,
                check=False,
                timeout_s=max(settings.lease_ttl_s / 4, 0.5),
                client_name=connection_name(hostname),
            ),
            hostname,
            interval_s=max(settings.lease_ttl_s / 3, 0.05),
        )
        self.engine: local.Engine | None = None
        self.feeder: Feeder | None = None
        self.findings: list[dict[str, Any]] = []
        self.monitor: Monitor | None = None
        self.progress = ProgressTally()  # one pipeline an interval for all running batches
        self.refused: str | None = None  # why the engine refuses this worker, once it does
        self.arch: str | None = None  # the checkpoint's architectures[0], when preflight read it
        self.plan: EnginePlan | None = None  # the engine plan its SGLang was launched with
        # An external engine's: the plan it would have been launched with (power-watch only).
        self.reference_plan: EnginePlan | None = None
        self.watchdog: StallWatchdog | None = None
        self.celery_worker: Any = None  # the WorkController, set by the engine bootstep
        # The model identity (`engine.fingerprint`), and each run's verdict against it (so a
        # run's record is read once per run, not per batch; a refused run's orders go back).
        self.model_identity: dict[str, Any] | None = None
        self.model_verdicts = RunVerdicts(settings.refused_run_memory_s)
        self.slots = PrefetchSlots(lambda: self.celery_worker)

    @property
    def presence_name(self) -> str | None:
        """The name of this worker's connection once Redis holds it (None: not named)."""
        return self.presence.name

    def start(self) -> None:
        self.presence.start()
        # httpx logs every request at INFO: once a second per worker from the telemetry loop.
        logging.getLogger("httpx").setLevel(logging.WARNING)
        hooks = local.Hooks(
            self._engine_died,
            self._engine_exhausted,
            self._engine_recovered,
            self._engine_restarted,
        )
        made = local.make(self.settings, self.hostname, hooks)
        self.settings = settings = made.settings
        self.arch, self.plan, self.reference_plan = made.arch, made.plan, made.reference
        self.engine = engine = made.engine  # before it starts: its hooks read it
        info = local.start(engine, settings)
        if self.plan is not None:
            cut = plan_check(self.plan, info, enforced_cap(info))
            if cut is not None:
                self.finding("engine_plan_cut", self.plan.to_json(), cut, "underused")
        # Sized from the cap the engine enforces, which may be below the configured one.
        cap = enforced_cap(info) or settings.max_running_requests
        max_inflight = settings.max_inflight or default_max_inflight(cap)
        model = settings.served_model_name or info.get("served_model_name") or "default"
        identity = {
            "kind": settings.engine_kind,
            "worker": self.hostname,
            "gpus": settings.gpus,
            "url": engine.base_url,
            "speculative_algorithm": info.get("speculative_algorithm"),
            "version": info.get("version"),
        }
        base_url = engine.base_url
        choice = choose(settings, self.arch)
        thinking = ThinkingSwitch(choice.thinking_key, choice.thinking_default)
        log.info("%s", choice.describe().removeprefix("# "))
        self.model_identity = checkpoint_identity(settings, choice)
        api_key = local.api_key(settings)
        chat = partial(
            EngineClient,
            base_url,
            model=str(model),
            api_key=api_key,
            timeout_s=settings.request_timeout_s,
            max_connections=max_inflight + 8,
            thinking=thinking,
            repetition=repetition_rule(settings),
            stream_chunk_tokens=settings.stream_chunk_tokens,
        )
        # SGLang's native API draws answers by token ids, so a cut one goes on from them;
        # their reasoning is split by the worker as the engine's own parser splits a chat's.
        parser = engine_reasoning_parser(settings.engine_kind, info, choice.reasoning_parser)
        native = draws_by_ids(settings.engine_kind, info)
        if native and not splits_reasoning(parser):
            native = False
            log.info(
                "answers drawn by the chat endpoint: the engine's reasoning parser %s marks "
                "reasoning in a way the worker does not split (a cut answer starts over)",
                parser,
            )
        defaults = read_sampling_defaults(str(settings.model or ""))
        if settings.engine_kind == "emulator" and defaults is None:
            defaults = {}  # the emulator's chat endpoint fills in no defaults either
        self.feeder = feeder = Feeder(
            (
                lambda: NativeClient(
                    base_url,
                    chat(),
                    api_key=api_key,
                    reasoning_parser=parser,
                    sampling_defaults=defaults,
                    max_connections=max_inflight + 8,
                )
            )
            if native
            else chat,
            engine,
            max_inflight,
            retries=settings.request_retries,
            engine_wait_s=min(settings.startup_timeout_s, 1800.0),
            busy_timeout_s=settings.busy_timeout_s,
            identity=identity,
            deadline=DeadlinePolicy(
                settings.request_timeout_s,
                settings.request_min_tokens_per_s,
                settings.request_deadline_margin,
            ),
            on_batch_sent=self.slots.batch_sent,
            on_answer_left=self.slots.offer,
            on_batch_arrived=self.slots.arrived,
            evidence=CrashEvidence(self.redis),
            exit_grace_s=0.0 if settings.engine_kind == "external" else EXIT_GRACE_S,
        )
        # Slots go on while the engine has room (workers.process.slots): it runs at most its
        # cap, and never more than the feeder sends.
        room_cap = min(cap, max_inflight) if cap else None
        self.slots.room = lambda: room_left(feeder.held, room_cap)
        log.info(
            "feeding %s with up to %d requests in flight (engine cap %s)",
            base_url,
            max_inflight,
            cap,
        )
        self.monitor = Monitor(
            settings,
            self.hostname,
            make_sampler(settings, base_url),
            self.engine_state,
            self.tokens_total,
            base_url,
            fleet=lambda now: fleet_state(self.redis, settings, now),
            engine_pid=lambda: getattr(self.engine, "pid", None),
            waste=lambda: (
                self.feeder.waste.to_counters() | self.feeder.quality.to_counters()
                if self.feeder
                else {}
            ),
        )
        self.monitor.start()
        self.watchdog = local.watchdog(
            settings,
            engine,
            lambda: feeder.inflight,
            lambda: feeder.streamed_tokens_total,
            self.on_stall,
        )

    def on_stall(self, figures: dict[str, Any]) -> None:
        """The engine is alive but produced nothing: kill and restart ours; stop consuming
        from an external one (it cannot be restarted from here) and hand its batches back."""
        engine = self.engine
        reason = (
            f"engine stalled: nothing generated for {figures['stalled_s']:.0f} s with "
            f"{figures['inflight']} requests in flight, {figures['health']}"
        )
        if isinstance(engine, EngineSupervisor):
            acted = engine.kill_stalled(reason)
            suggestion = "the engine was killed and restarted; if it recurs, read its log"
        else:
            acted = engine is not None
            suggestion = "the external engine stopped generating: restart it, then the worker"
            if engine is not None:
                engine.state = "exhausted"
                engine.last_error = reason
            if self.on_exhausted:
                self.on_exhausted(f"{reason}; this worker stops taking work")
            if self.feeder is not None:
                self.feeder.cancel_all()  # checkpointed and handed back to the queue
        if acted:
            self.finding("engine_stalled", figures, suggestion)

    def engine_alarm(self) -> dict[str, Any] | None:
        """The engine's state when it needs a person: its restart budget spent (a cool-down)
        or a crash loop (the same last error on consecutive deaths); None otherwise."""
        engine = self.engine
        if not isinstance(engine, EngineSupervisor):
            return None
        crash = engine.crash
        exhausted = engine.state == "exhausted"
        if not exhausted and not (crash and crash["loop"]):
            return None
        return {
            "worker": self.hostname,
            "queue": self.queue,
            "gpus": self.settings.gpus,
            "state": engine.state,
            "exhausted": exhausted,
            "crash": crash,
            "last_error": engine.last_error,
            "ts": time.time(),
            **engine.budget(),
        }

    def _engine_died(self) -> None:
        """After each engine death: a crash loop is published once it is one; with no order
        waiting, the running batches go back to the queue for a worker with room and this
        one takes none until its engine serves again (`workers.hand_back`)."""
        alarm = self.engine_alarm()
        crash = alarm["crash"] if alarm is not None else None
        if crash and crash["loop"] and crash["repeats"] == CRASH_LOOP_REPEATS:
            self.finding("crash_loop", alarm or {}, loop_suggestion(crash), "underused")
        self._publish_alarm(alarm)
        held = self.feeder.held if self.feeder is not None else 0
        engine = self.engine
        start_s = engine.last_start_s if isinstance(engine, EngineSupervisor) else None
        if self.refused is None and self.hand_back.died(self._orders_waiting(), held, start_s):
            log.warning("engine restarting with no order waiting: its %d prompts handed back", held)
            if self.on_pause is not None:
                self.on_pause("its engine is restarting: its batches are handed back")

    def _engine_restarted(self) -> None:
        """The engine serves again after a restart: take orders again if its batches went."""
        if self.hand_back.restarted() and self.refused is None and self.on_resume is not None:
            self.on_resume()

    def handing_back(self, run: str, batch: str) -> str | None:
        """Why the running batch goes back to the queue now (`execute`'s `handing_back`):
        as `HandBack.why` says, and only a batch whose next try would know all this one does
        (`Feeder.movable`: an answer that started over keeps its account here)."""
        engine, feeder = self.engine, self.feeder
        if not isinstance(engine, EngineSupervisor) or feeder is None:
            return None
        why = self.hand_back.why(engine.state == "ready", feeder.settled)
        if why is None:
            return None
        try:
            return why if feeder.movable(run, batch) else None
        except (RuntimeError, TimeoutError):  # the feeder's loop is gone or stuck: it stays
            return None

    def _orders_waiting(self) -> int | None:
        """Orders in this worker's queue, none taken yet (None: Redis did not answer)."""
        try:
            return queue_depth(self.redis, self.queue)
        except redis.RedisError as exc:
            log.warning("orders waiting not read (%s): the batches stay", exc)
            return None

    def _engine_exhausted(self, message: str) -> None:
        """The restart budget is spent: stop consuming (the bootstep's callback), say so in
        the findings and the alarms key, for the cool-down."""
        alarm = self.engine_alarm()
        if alarm is not None:
            self.finding("restart_budget_spent", alarm, budget_suggestion(alarm), "underused")
        self._publish_alarm(alarm)
        if self.on_exhausted is not None:
            self.on_exhausted(message)

    def _engine_recovered(self) -> None:
        """The engine serves again after its cool-down: consume again."""
        self._publish_alarm(self.engine_alarm())
        if self.on_recovered is not None:
            self.on_recovered()

    def _publish_alarm(self, alarm: dict[str, Any] | None) -> None:
        try:
            engine_alarms.publish(self.redis, self.hostname, alarm)
        except redis.RedisError as exc:
            log.warning("could not publish the engine's state: %s", exc)

    def finding(
        self,
        cause: str,
        numbers: dict[str, Any],
        suggestion: str,
        verdict: str = "unresponsive",
        run: str | None = None,
    ) -> None:
        """A finding the worker itself makes (about itself, or itself and `run`): log,
        `gpu_report`, and the findings stream."""
        finding = {
            "worker": self.hostname,
            "gpu_uuid": None,
            "verdict": verdict,
            "cause": cause,
            "numbers": numbers,
            "suggestion": suggestion,
            "ts": time.time(),
            "run": run,
        }
        log.error(
            "%s on %s: %s — %s",
            cause.upper().replace("_", " "),
            self.hostname,
            suggestion,
            orjson.dumps(numbers).decode(),
        )
        self.findings.append(finding)
        del self.findings[:-50]
        try:
            findings.record(self.redis, finding, self.settings.findings_maxlen)
        except redis.RedisError as exc:
            log.warning("could not record the %s finding: %s", cause, exc)

    def engine_state(self) -> EngineState:
        """What the engine and the client are doing now (no HTTP: the supervisor's view)."""
        engine = self.engine
        feeder = self.feeder
        supervised = engine if isinstance(engine, EngineSupervisor) else None
        # An external engine is judged against the plan it would have been launched with.
        plan = self.plan if self.plan is not None and self.plan.planned else self.reference_plan
        return EngineState.observe(
            engine.state if engine else "stopped",
            engine.server_info if engine else {},
            inflight=feeder.inflight if feeder else 0,
            inflight_cap=feeder.inflight_cap if feeder else 0,
            restarts=engine.restarts if engine else 0,
            waiting=feeder.waiting if feeder else 0,
            budget=supervised.budget() if supervised else None,
            crash=supervised.crash if supervised else None,
            plan_cap=plan.max_running_requests if plan else None,
            # The plan's flags are a fix only for an engine launched otherwise: one launched
            # with them and below the plan's cap cut it (engine_plan_cut); the limit's own fix.
            plan_fix=plan.fix if plan is not None and plan is self.reference_plan else None,
            mtp_planned_off=bool(plan and not plan.mtp),
        )

    def tokens_total(self) -> int:
        """Tokens this worker's engine generated so far, counted as they stream (the feeder's
        count): a long answer is GPU work from its first token, not from its end."""
        return self.feeder.streamed_tokens_total if self.feeder else 0

    def report(self) -> dict[str, Any]:
        """The recent GPU + engine window (the `gpu_report` inspect command's reply)."""
        if self.monitor is None or not self.consuming:
            # Starting: the power-watch counts its node's GPUs as claimed, and `enqueue` does
            # not tell anyone to start a worker for `queue`, which it will consume once up.
            return {
                "worker": self.hostname,
                "ok": False,
                "reason": "engine not started" if self.monitor is None else "not consuming yet",
                "node": socket.gethostname(),
                "queue": self.queue,
            }
        report = self.monitor.report()
        report["findings"] = self.findings[-5:]
        return report

    def refuse_work(self, message: str) -> None:
        """The engine refuses this worker itself (401/403/404): stop consuming, say why once.

        Kept as a finding (`gpu_report`, the power-watch) so the fleet view shows it too.
        """
        if self.refused is not None:
            return
        self.refused = message
        log.error(
            "ENGINE REFUSES THIS WORKER, it stops taking work: %s. Fix the setting and "
            "restart the worker; the order is back in the queue.",
            message,
        )
        self.findings.append({"worker": self.hostname, "cause": "engine_refused", "why": message})
        if self.on_exhausted is not None:
            self.on_exhausted(message)

    def consumer_started(self, qos: Any) -> None:
        self.slots.count_on(qos)

    def batch_ended(self, run: str, batch: str) -> None:
        """The batch's task is over (done, failed or handed back): the prefetch slot it
        handed on, if it did, is taken back."""
        self.slots.batch_ended(run, batch)

    def after_batch(self, summary: Any) -> None:
        """After a batch: re-read the engine's accept length and warn loudly if MTP is idle."""
        engine = self.engine
        if engine is None or engine.state != "ready":
            return
        info = engine.refresh_info()
        length = accept_length_from_server_info(info)
        summary.accept_length = length
        spec = info.get("speculative_algorithm")
        # The lifetime mean says nothing under adaptive drafting, which stops drafting at large
        # batches; the power-watch judges it from the interval accept length at small ones.
        judged = not info.get("speculative_adaptive")
        if spec and judged and length is not None and length < self.settings.min_accept_length:
            finding = {
                "worker": self.hostname,
                "cause": "mtp_ineffective",
                "accept_length": length,
                "suggestion": "the checkpoint's MTP weights are probably missing or not loaded "
                "(run `genfleet preflight`); without them MTP only costs time: fix or --no-mtp",
            }
            if not self.findings or self.findings[-1].get("cause") != "mtp_ineffective":
                log.error(
                    "MTP INEFFECTIVE on %s: accept length %.2f with %s", self.hostname, length, spec
                )
            self.findings.append(finding)
            del self.findings[:-50]

    def stop(self) -> None:
        if self.engine_alarm() is not None:
            self._publish_alarm(None)  # a stopped worker's engine is nobody's alarm
        if self.watchdog is not None:
            self.watchdog.stop()
        if self.monitor is not None:
            self.monitor.stop()
        if self.feeder is not None:
            self.feeder.close()
        if self.engine is not None:
            self.engine.stop()
        self.presence.stop()
