"""The one settings model: CLI flag, environment variable and record field share a name.

`--max-inflight` is `max_inflight` here and `GENFLEET_MAX_INFLIGHT` in the environment.
Settings are built at the edge (the CLI, a worker's start-up) and passed down; nothing reads
the environment at import time. Units live in the names (`timeout_s`, `power_w`).
"""

from __future__ import annotations

import io
from pathlib import Path
from typing import Any, Literal

from pydantic import Field, SecretStr, field_validator, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

EngineKind = Literal["sglang", "emulator", "external", "command"]


# The embedded store of one machine: one place per user, whatever the current directory, so a
# worker and the producer started from different directories share it.
DEFAULT_STORE = "~/.local/share/genfleet/store"


class Settings(BaseSettings):
    """Every knob of genfleet, from the producer to the engine emulator.

    Examples:
        Settings()                                  # environment + defaults
        Settings(redis_url="redis://:pw@host:6379/0", store="s3://bucket/runs")
        Settings.from_overrides({"max_inflight": None, "batch_size": 64})  # CLI: None = unset
    """

    model_config = SettingsConfigDict(
        env_prefix="GENFLEET_",
        extra="ignore",
        validate_default=True,
    )

    # --- where work and results live -------------------------------------------------------
    redis_url: SecretStr = SecretStr("redis://127.0.0.1:6379/0")
    store: str = DEFAULT_STORE  # made a file:// URL by the validator below
    s3_endpoint_url: str | None = None
    s3_region: str = "us-east-1"
    queue: str = "gpu"  # work orders wait on `{queue}.emulator` or `{queue}.<model>`
    # Redis re-delivers a late-acked message still running after this long (kombu
    # QoS.restore_visible): keep it at least twice the longest batch, in every process.
    visibility_timeout_s: int = 14_400

    # --- what to generate -------------------------------------------------------------------
    batch_size: int = Field(default=256, ge=1)
    # A batch is also closed when its expected generation work reaches this many tokens
    # (prompts x max_tokens), so no batch outlives the visibility timeout.
    batch_max_tokens: int = Field(default=4_000_000, ge=1)
    # The run's last this-many batches' worth of prompts go out in shrinking batches (0: every
    # batch full). Off by default: workers take a run's batches as they start, so at a few
    # batches per worker equal batches split the run most evenly (bench/RESULTS.md).
    batch_tail: int = Field(default=0, ge=0)
    max_tokens: int = Field(default=8192, ge=1)
    # `run` and `status --watch` where the output is no terminal (piped, nohup, CI): a status
    # line this often, where a terminal gets the live bar.
    progress_interval_s: float = Field(default=30.0, gt=0)
    temperature: float = Field(default=0.6, ge=0.0)
    top_p: float = Field(default=0.95, gt=0.0, le=1.0)
    thinking: bool = True
    # Sent to the engine only when set (None: the engine's or the model's default).
    top_k: int | None = Field(default=None, ge=-1)
    min_p: float | None = Field(default=None, ge=0.0, le=1.0)
    repetition_penalty: float | None = Field(default=None, gt=0.0)
    json_schema: str | None = None  # a JSON Schema file: every answer must match it
    chat_template_kwargs: str | None = None  # a JSON object, e.g. '{"enable_thinking": false}'
    system_prompt: str | None = None
    # A conversation's final assistant turn is the old answer to replace: it is kept in the
    # output record as `previous` and never sent. Without it, such a line is refused.
    regenerate: bool = False
    samples: int = Field(default=1, ge=1)
    limit: int | None = Field(default=None, ge=1)
    max_line_bytes: int = Field(default=8 * 1024 * 1024, ge=1)
    # The quality gate (common/quality.py, `GateSettings` says why these defaults): a run
    # whose last answers are mostly empty, short, cut or errors pauses itself. Recorded per
    # run by each enqueue of it; workers judge the run by what its enqueue recorded.
    quality_gate: bool = True
    quality_gate_min_answers: int = Field(default=50, ge=1)
    quality_window_answers: int = Field(default=200, ge=1)
    quality_gate_bad_share: float = Field(default=0.5, gt=0.0, le=1.0)
    quality_gate_shorter_ratio: float = Field(default=0.5, gt=0.0, le=1.0)
    quality_gate_shorter_share: float = Field(default=0.5, gt=0.0, le=1.0)
    # An enqueue of a run that exists (`run` again, `enqueue --resume`) with generation
    # parameters other than the run's applies them to the batches not yet done, recorded in
    # the run (`RUN/params-changes/`), instead of refusing them: e.g. after the quality gate
    # paused a run, `--change-params --max-tokens 4096`.
    change_params: bool = False

    # --- the engine -------------------------------------------------------------------------
    engine: EngineKind | None = None  # None: sglang when a model is given, else the emulator
    model: str | None = None
    served_model_name: str | None = None
    sglang_version: str | None = None  # None: read from the installed package
    engine_url: str | None = None  # --engine external
    engine_command: str | None = None  # --engine command, with {model} and {port}
    engine_health_path: str = "/health"
    engine_host: str = "127.0.0.1"
    port: int = Field(default=30000, ge=1, le=65535)
    gpus: str | None = None  # "0,1,2,3" or GPU UUIDs; None: whatever the worker sees
    tp_size: int = Field(default=1, ge=1)
    mem_fraction_static: float | None = Field(default=None, gt=0.0, lt=1.0)
    max_running_requests: int | None = Field(default=None, ge=1)
    context_length: int | None = Field(default=None, ge=1)
    # None: chosen from the checkpoint's architecture (qwen3, deepseek-v3, deepseek-r1);
    # "none" passes no parser.
    reasoning_parser: str | None = None
    # The chat_template_kwargs key that switches thinking: None from the architecture
    # (enable_thinking for Qwen3, thinking for DeepSeek V3.1+); "none" never sends one.
    thinking_switch: str | None = None
    # architectures[0] when config.json cannot be read (a hub id): decides the MTP and mamba
    # flags, the reasoning parser and the thinking switch.
    model_architecture: str | None = None
    tool_call_parser: str | None = None
    trust_remote_code: bool = False
    mamba_cache_strategy: str | None = None  # None: extra_buffer with MTP on hybrid models
    attention_backend: str | None = None
    enable_metrics: bool = True
    engine_api_key: SecretStr | None = None
    engine_log_level: str = "info"
    engine_extra_args: str = ""  # passed through to the engine, shell-split
    # SGLang's --stream-interval: answers stream a chunk every this many tokens. What the
    # engine drew and not yet sent (half a chunk an answer, on average) is lost at every cut:
    # in the chaos bench, 32 cost 4.4 % of the tokens kept, 8 cost 1.5 %, at the same
    # clean-run speed. Incremental chunks (`--incremental-streaming-output`) cost the engine
    # the same at any size.
    stream_chunk_tokens: int = Field(default=8, ge=1)
    mtp: bool = True
    # The engine plan (workers/engine/plan.py): SGLang's running-request cap, memory split and
    # radix cache sized from the checkpoint's config and the card's memory, for hybrid models;
    # off: the flags as given. `plan_gpu` names the card when none is seen (`h100`, `h200`, a
    # number of GiB: the plan printed without the GPU) or overrides NVML's figure; the plan
    # sizes each request's KV for `plan_prompt_tokens` + `plan_answer_tokens` (None:
    # `max_tokens`). An `mtp` given (flag or environment) is kept; otherwise the plan chooses.
    engine_plan: bool = True
    plan_gpu: str | None = None
    plan_answer_tokens: int | None = Field(default=None, ge=1)
    plan_prompt_tokens: int = Field(default=256, ge=1)
    speculative_algorithm: str = "EAGLE"
    speculative_num_steps: int = Field(default=3, ge=1)
    speculative_eagle_topk: int = Field(default=1, ge=1)
    speculative_num_draft_tokens: int = Field(default=4, ge=1)
    # SGLang's --speculative-adaptive (0.5.12+): draft steps follow accept rate and batch size.
    speculative_adaptive: bool = False
    startup_timeout_s: float = Field(default=3600.0, gt=0)
    stop_timeout_s: float = Field(default=30.0, gt=0)
    # A rate: restart_budget engine restarts per restart_window_s. Spent, the worker stops
    # taking work for restart_cooldown_s, then starts its engine again and consumes again.
    restart_budget: int = Field(default=5, ge=0)
    restart_window_s: float = Field(default=3600.0, gt=0)
    restart_cooldown_s: float = Field(default=600.0, gt=0)
    # The first restart's delay, doubled for each restart since an engine last served as
    # long as it took to start (a crash loop), not for every restart in the window.
    restart_backoff_s: float = Field(default=2.0, ge=0)
    # `worker --gpus … --tp-size …`: how often each child worker that dies is restarted.
    worker_restart_budget: int = Field(default=5, ge=0)
    # An engine with requests in flight that produced nothing (no completion, no generated
    # token in /metrics) for a window and fails /health_generate is killed and restarted
    # (an external one: the worker stops consuming). The window is this long until the engine
    # has worked this long, then 4x its longest pause, at least a quarter of this
    # (workers/engine/watchdog.py). An engine that starts and for this long uses no CPU time
    # and writes no log line is frozen, killed and started again (workers/engine/
    # start_watch.py). 0 turns both off.
    engine_stall_timeout_s: float = Field(default=300.0, ge=0)
    # An engine that dies with no order waiting hands its worker's running batches back to
    # the queue for a worker with room, when its last start took at least this long (a
    # model's load: minutes). A move costs each batch its store reads again and each answer
    # a prefill of what it drew: seconds, more than a start shorter than this saves.
    hand_back_min_start_s: float = Field(default=30.0, ge=0)
    min_accept_length: float = Field(default=1.2, ge=1.0)
    log_dir: str | None = None  # engine logs; None: a temporary directory

    # "gpu": consume work orders with an engine; "control": run beat tasks only, no engine.
    role: Literal["gpu", "control"] = "gpu"

    # --- feeding the engine -----------------------------------------------------------------
    worker_concurrency: int = Field(default=3, ge=1)  # batches in flight per worker
    max_inflight: int | None = Field(default=None, ge=1)  # None: engine cap x 1.25 + 4
    # One request's deadline is request_timeout_s + its max_tokens at the engine's measured
    # per-sequence pace (never below request_min_tokens_per_s) x request_deadline_margin
    # (workers/feeding/deadline.py); past it, that prompt gets an error record, its batch goes on.
    request_timeout_s: float = Field(default=3600.0, gt=0)
    request_min_tokens_per_s: float = Field(default=2.0, gt=0)
    request_deadline_margin: float = Field(default=2.0, ge=1.0)
    request_retries: int = Field(default=5, ge=0)
    # One prompt answered only "busy" (429, queue full) for this long fails its batch's try
    # (retried later); backpressure alone never fails a prompt.
    busy_timeout_s: float = Field(default=1800.0, gt=0)
    batch_retries: int = Field(default=3, ge=0)
    checkpoint_interval_s: float = Field(default=60.0, gt=0)
    # Between two checkpoints, what each answer in flight drew is appended to Redis this often
    # (workers/drawn_journal.py): a lost worker costs each answer about this much drawing, not
    # half a checkpoint interval. About 18 bytes a token at 12 tokens an answer a line (an
    # engine running 98 answers at 25 tok/s each: 44 KB/s), held for one checkpoint interval
    # at most. 0: answers in flight are kept at checkpoints only.
    inflight_journal_interval_s: float = Field(default=0.5, ge=0)
    # On SIGTERM a worker stops taking work and lets running batches finish for this long;
    # then it checkpoints them and hands them back to the queue, and stops its engine.
    shutdown_grace_s: float = Field(default=30.0, ge=0)
    lease_ttl_s: float = Field(default=60.0, gt=0)
    # A batch whose worker died or vanished this many times is parked in the failed set
    # (a batch that crashes its worker would otherwise travel the fleet forever).
    max_deliveries: int = Field(default=3, ge=1)
    # A worker that does not serve a run's model (common/model_identity.py) hands the run's
    # orders back and remembers the run for this long (no store read per order; `status`
    # shows the refusal as long); the batch slot that handed one back rests
    # refused_order_rest_s before taking another, so that a queue only refusing workers
    # consume goes round slowly, never in a hot loop (workers/admission.py).
    refused_run_memory_s: float = Field(default=600.0, gt=0)
    refused_order_rest_s: float = Field(default=2.0, ge=0)
    reaper_interval_s: float = Field(default=30.0, gt=0)
    # How often the control worker lists running runs' outputs and repairs Redis's progress
    # copy from them (what `status` reads): a lost count is right again within this long.
    reconcile_interval_s: float = Field(default=120.0, gt=0)
    # `run` and `status --watch` give up on a run when, for this many leases (or the engine's
    # start-up time, if longer), no prompt finished and no batch of it was held by a worker.
    wait_deadline_leases: int = Field(default=10, ge=1)
    # The repetition guard (workers/feeding/repetition.py): a streaming answer whose last
    # repetition_min_span_chars (and at least repetition_min_repeats copies) are one block of
    # repetition_min_block_chars … repetition_max_block_chars repeated is stopped and recorded
    # as finish_reason "repetition"; a block too long for those copies to fit
    # repetition_max_span_chars needs that span and three copies; a block shorter than
    # repetition_min_block_chars ("\n", " the") needs repetition_short_span_chars. Spans count a
    # character outside ASCII as four. Never stopped: a block the prompt holds, repetition the
    # prompt asks for (up to twice the count it names).
    repetition_guard: bool = True
    repetition_min_span_chars: int = Field(default=3000, ge=1)
    repetition_min_repeats: int = Field(default=8, ge=2)
    repetition_min_block_chars: int = Field(default=10, ge=1)
    repetition_max_block_chars: int = Field(default=1500, ge=1)
    repetition_max_span_chars: int = Field(default=6000, ge=1)
    repetition_short_span_chars: int = Field(default=1000, ge=64)

    # --- watching ---------------------------------------------------------------------------
    # One power-watch round per power window: each round judges a fresh minute, and in Flower
    # its rows do not drown the batches (`/tasks?name=genfleet.power_watch` lists them).
    power_watch_interval_s: float = Field(default=60.0, gt=0)
    power_window_s: float = Field(default=60.0, gt=0)
    underuse_threshold: float = Field(default=0.70, gt=0.0, lt=1.0)
    sample_interval_s: float = Field(default=1.0, gt=0)
    metrics_port: int | None = Field(default=None, ge=0, le=65535)  # None: no exporter
    metrics_host: str = "127.0.0.1"  # 0.0.0.0 inside a container that publishes the port
    findings_maxlen: int = Field(default=10_000, ge=1)
    # The same power-watch finding (worker, GPU, cause) is alerted again only after this long.
    realert_after_s: float = Field(default=1800.0, gt=0)
    # USD per GPU-hour: `status`, `report` and `tune` then show the cost per million tokens.
    gpu_hour_cost: float | None = Field(default=None, ge=0)

    # --- the engine emulator (a dry-run engine, never a silent fallback) --------------------
    emulator_time_scale: float = Field(default=1.0, gt=0)  # 10 = ten times real time
    emulator_mean_completion_tokens: int = Field(default=1800, ge=1)
    emulator_max_completion_tokens: int = Field(default=8192, ge=1)
    emulator_load_s: float = Field(default=2.0, ge=0)
    emulator_warmup_s: float = Field(default=1.0, ge=0)
    emulator_step_base_ms: float = Field(default=12.0, ge=0)
    emulator_step_per_request_ms: float = Field(default=0.25, ge=0)
    emulator_accept_length: float = Field(default=2.6, ge=1.0)
    emulator_power_limit_w: float = Field(default=700.0, gt=0)
    emulator_idle_power_w: float = Field(default=80.0, ge=0)
    emulator_fail_after_requests: int | None = None  # crash after N requests (fault tests)
    # Engine answers a test needs (SGLang's and OpenAI-compatible servers' odd ones):
    emulator_429_rate: float = Field(default=0.0, ge=0.0, le=1.0)  # 429 with Retry-After
    emulator_retry_after_s: float = Field(default=1.0, ge=0.0)
    emulator_abort_rate: float = Field(default=0.0, ge=0.0, le=1.0)  # 200, finish "abort"
    # Share of prompts whose answer falls into a loop (one block repeated to max_tokens) after
    # a drawn number of tokens, and share whose answer repeats legitimately (tables, lists,
    # code, a refrain, an enumeration): what the repetition guard must stop, and must not.
    emulator_loop_rate: float = Field(default=0.0, ge=0.0, le=1.0)
    emulator_legit_repeat_rate: float = Field(default=0.0, ge=0.0, le=1.0)
    # "sglang": usage.reasoning_tokens; "openai": usage.completion_tokens_details.reasoning_tokens
    emulator_usage_shape: Literal["sglang", "openai"] = "sglang"
    # Enforce fewer running requests than configured, as SGLang does when KV or the mamba
    # pool is short (reported as internal_states[i].effective_max_running_requests_per_dp).
    emulator_effective_max_running_requests: int | None = Field(default=None, ge=1)
    emulator_request_log: str | None = None  # a file: one JSON line per request received, ended
    # The emulated node's other GPUs, which no worker claims, and a stranger process holding
    # memory on the engine's GPU: what the power-watch's unclaimed_gpu / foreign_process see.
    emulator_unclaimed_gpus: int = Field(default=0, ge=0)
    emulator_foreign_process_mib: int = Field(default=0, ge=0)

    @field_validator("store")
    @classmethod
    def _store_url(cls, value: str) -> str:
        return store_url(value)

    @field_validator("engine_api_key")
    @classmethod
    def _key_not_a_flag(cls, value: SecretStr | None) -> SecretStr | None:
        # The key reaches SGLang through its --config file, which SGLang turns into argv:
        # a key beginning with '-' is read as the next flag and the engine does not start.
        if value is not None and value.get_secret_value().startswith("-"):
            raise ValueError("must not begin with '-' (the engine would read it as a flag)")
        return value

    @field_validator("chat_template_kwargs")
    @classmethod
    def _kwargs_object(cls, value: str | None) -> str | None:
        if value is not None and not value.strip().startswith("{"):
            raise ValueError(f'must be a JSON object, e.g. {{"enable_thinking": false}}: {value!r}')
        return value

    @model_validator(mode="after")
    def _consistent(self) -> Settings:
        if self.engine == "external" and not self.engine_url:
            raise ValueError("--engine external needs --engine-url")
        if self.engine == "command" and not self.engine_command:
            raise ValueError("--engine command needs --engine-command")
        if self.engine == "sglang" and not self.model:
            raise ValueError("--engine sglang needs --model")
        if not self.thinking and self.thinking_switch == "none":
            # Nothing could turn thinking off: refused here, not ignored by every worker.
            raise ValueError("--no-thinking needs a thinking switch; --thinking-switch is none")
        return self

    @classmethod
    def from_overrides(cls, overrides: dict[str, Any]) -> Settings:
        """Environment and defaults, overridden by a `--settings-file` (the `settings_file`
        key), overridden by the CLI flags that were given
        (not None). Raises ValueError for a settings file that is missing or malformed."""
        given = {k: v for k, v in overrides.items() if v is not None}
        path = given.pop(SETTINGS_FILE, None)
        from_file = read_settings_file(path) if path else {}
        return cls(**{**from_file, **given})

    @property
    def engine_kind(self) -> EngineKind:
        """The engine to run: an explicit choice, or sglang with a model, else the emulator."""
        if self.engine is not None:
            return self.engine
        return "sglang" if self.model else "emulator"

    @property
    def summary_ttl_s(self) -> float:
        """How old a worker's pushed summary may be before the worker counts as silent:
        about three power-watch rounds (its pushes come four times a round)."""
        return max(3 * self.power_watch_interval_s, 10 * self.sample_interval_s)

    def redacted(self) -> dict[str, Any]:
        """The settings as a dict with secrets masked, safe for logs and task results."""
        data = self.model_dump()
        data["redis_url"] = redact_url(self.redis_url.get_secret_value())
        if self.engine_api_key is not None:
            data["engine_api_key"] = "**********"
        return data

    def child_env(self) -> dict[str, str]:
        """These settings as GENFLEET_ variables, for processes this one starts."""
        env: dict[str, str] = {}
        for name, value in self.model_dump().items():
            if value is None:
                continue
            if isinstance(value, SecretStr):
                value = value.get_secret_value()
            if isinstance(value, bool):
                value = "true" if value else "false"
            env[f"GENFLEET_{name.upper()}"] = str(value)
        return env


def store_url(value: str) -> str:
    """`s3://…` and `file://…` as given; a directory (`~` expanded) as its file:// URL."""
    if value.startswith(("s3://", "file://")):
        return value
    if "://" in value:
        raise ValueError(f"store must be s3://bucket/prefix or file:///path, got {value!r}")
    return Path(value).expanduser().resolve().as_uri()


def redact_url(url: str) -> str:
    """`redis://:secret@host:6379/0` → `redis://:***@host:6379/0`: never log a password."""
    scheme, sep, rest = url.partition("://")
    if not sep or "@" not in rest:
        return url
    creds, _, host = rest.rpartition("@")
    user = creds.split(":", 1)[0] if ":" in creds else ""
    return f"{scheme}://{user}:***@{host}"


def setting_names() -> set[str]:
    """Every GENFLEET_ variable name that means something."""
    return {f"GENFLEET_{name.upper()}" for name in Settings.model_fields}


SETTINGS_FILE = "settings_file"  # the --settings-file flag: not a setting, a source of them


def read_settings_file(path: str | Path) -> dict[str, str]:
    """The settings a `KEY=VALUE` file of GENFLEET_ names holds, as field name → raw value.

    Written by `genfleet tune --out` and read by `--settings-file` on `worker` and `run`, with
    python-dotenv's parser, so it reads what `.env` files mean everywhere: `#` comments,
    `export `, single or double quotes (a `#` inside quotes is part of the value), escapes in
    double quotes. No `${VAR}` expansion: a value is taken as written. Raises ValueError naming
    the file and line of an unknown name or a line that is not `NAME=VALUE`.

        GENFLEET_MTP=true
        GENFLEET_MAX_RUNNING_REQUESTS=256   # → {"mtp": "true", "max_running_requests": "256"}
        GENFLEET_ENGINE_EXTRA_ARGS="--foo #bar"           # → {"engine_extra_args": "--foo #bar"}
    """
    from dotenv.parser import parse_stream

    try:
        text = Path(path).read_text(encoding="utf-8")
    except OSError as exc:
        raise ValueError(f"--settings-file {path}: {exc.strerror or exc}") from exc
    except UnicodeDecodeError as exc:
        raise ValueError(
            f"--settings-file {path}: not UTF-8 (byte {exc.start}): a file of GENFLEET_NAME=VALUE "
            "lines, as `genfleet tune --settings-out` writes"
        ) from exc
    known = setting_names()
    values: dict[str, str] = {}
    for binding in parse_stream(io.StringIO(text)):
        if binding.key is None and not binding.error:
            continue  # a blank line or a comment
        if binding.error or binding.key not in known or binding.value is None:
            line = binding.original.string.strip()
            raise ValueError(
                f"{path}:{binding.original.line}: expected GENFLEET_NAME=VALUE, got {line!r}"
            )
        values[binding.key.removeprefix("GENFLEET_").lower()] = binding.value
    return values
