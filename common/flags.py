"""Every setting as a command-line flag, generated from the one settings model; the one error
exit of the command line.

`with_settings()` gives a Typer command one `--field-name` option per `Settings` field, with
the field's type, default and help, grouped in `--help` by panel; the command receives the
`Settings` built from the environment, a `--settings-file` and the flags given:

    @with_settings(exclude={"role"})
    def worker(settings: Settings, hostname: str | None = None) -> None: ...

    genfleet worker --tp-size 2 --no-mtp --settings-file tuned.env

A flag that is not given is None here and leaves the environment's (or the file's) value; an
unknown flag fails in the parser (exit 2, the flag named).
"""

from __future__ import annotations

import enum
import functools
import inspect
import sys
import types
from collections.abc import Callable, Iterable
from typing import Annotated, Any, Literal, NoReturn, Union, get_args, get_origin

import typer
from pydantic import SecretStr, ValidationError
from rich.console import Console
from rich.markup import escape

from genfleet.common.settings import SETTINGS_FILE, Settings, redact_url

_stderr = Console(stderr=True)

STORE = "Redis, queue and store"
GENERATION = "Generation"
ENGINE = "Engine"
MTP = "MTP (speculative decoding)"
FEEDING = "Feeding"
WATCH = "Power-watch and metrics"
EMULATOR = "Emulator (dry runs)"
OTHER = "Other settings"

# field → (panel, help). A field missing here still gets a flag, in OTHER, helped by its name.
FIELDS: dict[str, tuple[str, str]] = {
    "redis_url": (STORE, "broker and state; prefer the environment for a password"),
    "store": (STORE, "where runs live: s3://bucket/prefix, file:///path or a directory"),
    "s3_endpoint_url": (STORE, "S3-compatible endpoint (MinIO, SeaweedFS, ...)"),
    "s3_region": (STORE, "S3 region"),
    "queue": (STORE, "the Celery queue of work orders"),
    "visibility_timeout_s": (STORE, "Redis re-delivers an unacked batch after this long"),
    "role": (STORE, "gpu: consume work with an engine; control: beat tasks only"),
    "batch_size": (GENERATION, "prompts per batch"),
    "batch_max_tokens": (GENERATION, "close a batch when prompts x max_tokens reach this"),
    "batch_tail": (GENERATION, "the last N batches' prompts go out in shrinking batches"),
    "max_tokens": (GENERATION, "completion cap per prompt"),
    "temperature": (GENERATION, "sampling temperature"),
    "top_p": (GENERATION, "nucleus sampling"),
    "thinking": (GENERATION, "let the model reason before it answers"),
    "top_k": (GENERATION, "top-k sampling; unset: the engine's default"),
    "min_p": (GENERATION, "min-p sampling; unset: the engine's default"),
    "repetition_penalty": (GENERATION, "repetition penalty; unset: the engine's default"),
    "json_schema": (GENERATION, "a JSON Schema file every answer must match"),
    "chat_template_kwargs": (GENERATION, 'a JSON object for the chat template, e.g. {"a": 1}'),
    "system_prompt": (GENERATION, "prepended to every conversation without one"),
    "quality_gate": (
        GENERATION,
        "pause the run when most of its last answers are empty, short, cut or errors",
    ),
    "quality_gate_min_answers": (GENERATION, "answers the quality gate waits for before judging"),
    "quality_window_answers": (GENERATION, "the last answers the live shares and the gate judge"),
    "quality_gate_bad_share": (GENERATION, "share of bad answers that pauses the run"),
    "quality_gate_shorter_ratio": (
        GENERATION,
        "--regenerate: a new answer under this share of the old one's length is shorter",
    ),
    "quality_gate_shorter_share": (
        GENERATION,
        "--regenerate: share of shorter new answers that pauses the run",
    ),
    "change_params": (
        GENERATION,
        "a run that exists goes on with the generation parameters given, for what is not done",
    ),
    "regenerate": (
        GENERATION,
        "replace each conversation's final assistant answer (kept as previous)",
    ),
    "samples": (GENERATION, "completions per prompt"),
    "limit": (GENERATION, "first N prompts only"),
    "max_line_bytes": (GENERATION, "longer input lines are rejected"),
    "engine": (ENGINE, "unset: sglang with --model, else the emulator"),
    "model": (ENGINE, "checkpoint path or name"),
    "served_model_name": (ENGINE, "the name requests use; unset: the engine's"),
    "sglang_version": (ENGINE, "unset: read from the installed package"),
    "engine_url": (ENGINE, "base URL of an --engine external server"),
    "engine_command": (ENGINE, "--engine command: argv with {model}, {port}, {host}"),
    "engine_health_path": (ENGINE, "the engine's readiness path"),
    "engine_host": (ENGINE, "the engine listens here"),
    "port": (ENGINE, "the engine's port (one GPU group per 10 ports)"),
    "gpus": (ENGINE, "0,1,2,3 or GPU UUIDs; unset: what the worker sees"),
    "tp_size": (ENGINE, "tensor parallelism: GPUs per engine"),
    "mem_fraction_static": (ENGINE, "SGLang's static memory share"),
    "progress_interval_s": (GENERATION, "seconds between status lines where no terminal shows"),
    "engine_plan": (
        ENGINE,
        "size SGLang's cap, memory split and radix cache from the model and the card "
        "(hybrid models)",
    ),
    "plan_gpu": (ENGINE, "the card the engine plan is for: h100, h200, … or GiB (default: NVML)"),
    "plan_answer_tokens": (ENGINE, "answer tokens the plan sizes each request's KV for"),
    "plan_prompt_tokens": (ENGINE, "prompt tokens the plan sizes each request's KV for"),
    "max_running_requests": (ENGINE, "the engine's running-batch cap"),
    "context_length": (ENGINE, "the engine's context window"),
    "reasoning_parser": (ENGINE, "SGLang reasoning parser; unset: the model family's"),
    "thinking_switch": (ENGINE, "chat_template_kwargs key that switches thinking; none: none"),
    "model_architecture": (ENGINE, "architectures[0] when config.json cannot be read"),
    "tool_call_parser": (ENGINE, "SGLang tool-call parser"),
    "trust_remote_code": (ENGINE, "run the checkpoint's own code"),
    "mamba_cache_strategy": (ENGINE, "unset: extra_buffer with MTP on hybrid models"),
    "attention_backend": (ENGINE, "SGLang attention backend"),
    "enable_metrics": (ENGINE, "the engine's Prometheus metrics"),
    "engine_api_key": (ENGINE, "bearer key of the engine; prefer the environment"),
    "engine_log_level": (ENGINE, "the engine's log level"),
    "engine_extra_args": (ENGINE, "more engine flags, shell-split"),
    "stream_chunk_tokens": (ENGINE, "SGLang's --stream-interval: tokens per streamed chunk"),
    "startup_timeout_s": (ENGINE, "give up on an engine not ready after this long"),
    "stop_timeout_s": (ENGINE, "SIGKILL an engine still running this long after SIGTERM"),
    "restart_budget": (ENGINE, "engine restarts per --restart-window-s before a cool-down"),
    "restart_window_s": (ENGINE, "the window the restart budget counts over"),
    "restart_cooldown_s": (ENGINE, "a worker whose budget is spent takes work again after this"),
    "restart_backoff_s": (ENGINE, "first wait before an engine restart"),
    "engine_stall_timeout_s": (
        ENGINE,
        "kill and restart an engine that generates nothing this long with work in flight, or"
        " that starts and moves not at all (no CPU time, no log line) this long; 0: off",
    ),
    "hand_back_min_start_s": (
        ENGINE,
        "an engine whose last start took this long or more hands its running batches back to"
        " the queue when it dies with no order waiting, for a worker with room",
    ),
    "worker_restart_budget": (ENGINE, "restarts of each dead child worker of a --gpus worker"),
    "log_dir": (ENGINE, "engine and run logs; unset: a temporary directory"),
    "mtp": (MTP, "speculative decoding with the checkpoint's MTP head"),
    "speculative_algorithm": (MTP, "SGLang speculative algorithm"),
    "speculative_num_steps": (MTP, "draft steps"),
    "speculative_eagle_topk": (MTP, "draft branching"),
    "speculative_num_draft_tokens": (MTP, "draft tokens verified per step"),
    "speculative_adaptive": (
        MTP,
        "SGLang's --speculative-adaptive (0.5.12+): draft steps follow the batch",
    ),
    "min_accept_length": (MTP, "warn below this accept length"),
    "worker_concurrency": (FEEDING, "batches in flight per worker"),
    "max_inflight": (FEEDING, "requests in flight per engine; unset: cap x 1.25 + 4"),
    "request_timeout_s": (FEEDING, "one request's deadline before its max_tokens add theirs"),
    "request_min_tokens_per_s": (FEEDING, "the slowest per-sequence pace a deadline assumes"),
    "request_deadline_margin": (FEEDING, "a deadline's max_tokens time at the pace, times this"),
    "request_retries": (FEEDING, "tries of one request"),
    "busy_timeout_s": (FEEDING, "a prompt answered only 429/queue full this long fails its try"),
    "batch_retries": (FEEDING, "tries of one batch before its failed set"),
    "checkpoint_interval_s": (FEEDING, "a running batch saves its progress this often"),
    "inflight_journal_interval_s": (
        FEEDING,
        "between checkpoints, answers in flight keep their new tokens in Redis this often (0: off)",
    ),
    "shutdown_grace_s": (FEEDING, "on SIGTERM, running batches finish for this long"),
    "lease_ttl_s": (FEEDING, "a batch without lease for this long is re-enqueued"),
    "max_deliveries": (FEEDING, "a batch whose worker died this often is parked as poison"),
    "refused_run_memory_s": (
        FEEDING,
        "a worker that does not serve a run's model remembers it (and status shows why) this long",
    ),
    "refused_order_rest_s": (
        FEEDING,
        "after handing back an order of a run it does not serve, a batch slot rests this long",
    ),
    "reaper_interval_s": (FEEDING, "how often expired leases and lost orders are looked for"),
    "reconcile_interval_s": (
        FEEDING,
        "how often the control worker repairs the progress copy status reads from the store",
    ),
    "wait_deadline_leases": (FEEDING, "run/status --watch give up after this many idle leases"),
    "repetition_guard": (FEEDING, "stop an answer that loops as it streams"),
    "repetition_min_span_chars": (FEEDING, "a loop's repeated tail spans at least this"),
    "repetition_min_repeats": (FEEDING, "a loop repeats its block at least this often"),
    "repetition_min_block_chars": (FEEDING, "shortest block a loop repeats"),
    "repetition_max_block_chars": (FEEDING, "longest block a loop repeats"),
    "repetition_max_span_chars": (FEEDING, "a long block's loop is stopped at this span"),
    "repetition_short_span_chars": (FEEDING, "a loop of a block under the shortest: this span"),
    "power_watch_interval_s": (WATCH, "how often the fleet is judged"),
    "power_window_s": (WATCH, "the window a verdict looks at"),
    "underuse_threshold": (WATCH, "share of the power limit below which a GPU is underused"),
    "sample_interval_s": (WATCH, "GPU and engine sampling period"),
    "metrics_port": (WATCH, "Prometheus exporter port; unset: no exporter"),
    "metrics_host": (WATCH, "the exporter listens here (0.0.0.0 in a container)"),
    "findings_maxlen": (WATCH, "findings kept in the Redis stream"),
    "realert_after_s": (WATCH, "the same finding is alerted again after this long"),
    "gpu_hour_cost": (WATCH, "USD per GPU-hour: status, report and tune show cost per M tokens"),
    "emulator_time_scale": (EMULATOR, "10 = ten times real time"),
    "emulator_mean_completion_tokens": (EMULATOR, "mean completion length"),
    "emulator_max_completion_tokens": (EMULATOR, "longest completion"),
    "emulator_load_s": (EMULATOR, "model load time"),
    "emulator_warmup_s": (EMULATOR, "warm-up time"),
    "emulator_step_base_ms": (EMULATOR, "decode step time, empty batch"),
    "emulator_step_per_request_ms": (EMULATOR, "decode step time added per request"),
    "emulator_accept_length": (EMULATOR, "accept length with MTP on"),
    "emulator_power_limit_w": (EMULATOR, "the emulated GPU's power limit"),
    "emulator_idle_power_w": (EMULATOR, "the emulated GPU's idle power"),
    "emulator_fail_after_requests": (EMULATOR, "crash after N requests (fault tests)"),
    "emulator_429_rate": (EMULATOR, "share of requests answered 429 with Retry-After"),
    "emulator_retry_after_s": (EMULATOR, "the Retry-After of those 429s"),
    "emulator_abort_rate": (EMULATOR, 'share of answers cut short with finish_reason "abort"'),
    "emulator_loop_rate": (EMULATOR, "share of answers that loop until max_tokens"),
    "emulator_legit_repeat_rate": (EMULATOR, "share of answers that repeat legitimately"),
    "emulator_usage_shape": (EMULATOR, "sglang or openai (completion_tokens_details)"),
    "emulator_effective_max_running_requests": (EMULATOR, "enforce fewer running than configured"),
    "emulator_request_log": (EMULATOR, "a file: one JSON line per request received and ended"),
    "emulator_unclaimed_gpus": (EMULATOR, "GPUs of the emulated node no worker claims"),
    "emulator_foreign_process_mib": (EMULATOR, "MiB a stranger process holds on the engine's GPU"),
}

PANELS = (STORE, GENERATION, ENGINE, MTP, FEEDING, WATCH, EMULATOR, OTHER)


def fail(message: str, code: int = 2) -> NoReturn:
    """The one error exit of the command line: `error: …` on stderr, then exit `code`.

    2: a usage or setup error (the default, as click's own); 1: the work itself failed.
    SystemExit, not click's Exit: no `except Exception` on the way can swallow it, and it ends
    the process the same inside a command or around one.
    """
    # Plain text: the message may quote the user's data (`p.jsonl:269 [prompt]: …`).
    _stderr.print(f"[bold red]error:[/] {escape(message)}", highlight=False, soft_wrap=True)
    sys.exit(code)


def flag(name: str) -> str:
    """`max_inflight` → `--max-inflight`."""
    return "--" + name.replace("_", "-")


def _base_type(annotation: Any) -> Any:
    """`int | None` → int; `Literal["a"] | None` → Literal["a"]."""
    if get_origin(annotation) in (Union, types.UnionType):
        members = [a for a in get_args(annotation) if a is not type(None)]
        if len(members) == 1:
            return members[0]
    return annotation


def _shown_default(name: str) -> str | bool:
    """The model's default as `--help` shows it; secrets masked, nothing read from anywhere."""
    field = Settings.model_fields[name]
    if field.default_factory is not None:
        return str(field.default_factory())  # type: ignore[call-arg]
    default = field.default
    if default is None:
        return False
    if isinstance(default, SecretStr):
        return redact_url(default.get_secret_value()) if name == "redis_url" else "***"
    if isinstance(default, bool):
        return "true" if default else "false"
    return str(default)


def _choice(name: str, values: list[str]) -> Any:
    """A str Enum of `values`, which is how typer shows and checks a choice in every version."""
    return enum.Enum(name, {v: v for v in values}, type=str)


def setting_parameter(name: str) -> inspect.Parameter:
    """The Typer parameter of one setting: `--name`, its type, default shown, help, panel.

    Booleans become `--x/--no-x`, Literals a choice, the rest keep their scalar type (secrets
    are text); the parameter's own default is None, meaning "not given".
    """
    field = Settings.model_fields[name]
    panel, help_text = FIELDS.get(name, (OTHER, ""))
    help_text = f"{help_text} [GENFLEET_{name.upper()}]".strip()
    base = _base_type(field.annotation)
    decls = [flag(name)]
    kind: Any = str  # text, secrets included
    if base is bool:
        decls = [f"{flag(name)}/--no-{flag(name)[2:]}"]
        kind = bool
    elif get_origin(base) is Literal:  # a choice: typer takes Enums in every version
        kind = _choice(name, [str(v) for v in get_args(base)])
    elif base in (int, float):
        kind = base
    option = typer.Option(
        *decls, help=help_text, rich_help_panel=panel, show_default=_shown_default(name)
    )
    return inspect.Parameter(
        name,
        inspect.Parameter.KEYWORD_ONLY,
        default=None,
        annotation=Annotated[kind | None, option],
    )


def settings_file_parameter() -> inspect.Parameter:
    option = typer.Option(
        "--settings-file",
        help="GENFLEET_NAME=VALUE lines (as `genfleet tune` writes): over the environment, "
        "under the flags",
        rich_help_panel=STORE,
    )
    return inspect.Parameter(
        SETTINGS_FILE,
        inspect.Parameter.KEYWORD_ONLY,
        default=None,
        annotation=Annotated[str | None, option],
    )


def setting_names_for(exclude: Iterable[str] = ()) -> list[str]:
    """The settings a command takes as flags, in panel order, then in the model's order."""
    skip = set(exclude)
    names = [n for n in Settings.model_fields if n not in skip]
    order = {panel: i for i, panel in enumerate(PANELS)}
    return sorted(names, key=lambda n: order[FIELDS.get(n, (OTHER, ""))[0]])


def validation_message(exc: ValidationError) -> str:
    """A pydantic error in the CLI's words, naming the flag and the variable it may come from:
    `--batch-size (GENFLEET_BATCH_SIZE): Input should be greater than or equal to 1 (got 0)`."""
    parts = []
    for error in exc.errors():
        where = ", ".join(f"{flag(str(p))} (GENFLEET_{str(p).upper()})" for p in error["loc"])
        message = str(error["msg"]).removeprefix("Value error, ")
        given = error.get("input")
        shown = "" if not where or isinstance(given, dict) else f" (got {given!r})"
        parts.append(f"{where}: {message}{shown}" if where else message)
    return "; ".join(parts)


def settings_from(values: dict[str, Any]) -> Settings:
    """The Settings of the flags given (None = not given), or the one error exit (2)."""
    given = {k: (v.value if isinstance(v, enum.Enum) else v) for k, v in values.items()}
    try:
        return Settings.from_overrides(given)
    except ValidationError as exc:
        fail(validation_message(exc))
    except ValueError as exc:
        fail(str(exc).replace("\n", " "))


def with_settings(
    exclude: Iterable[str] = (),
) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Decorate a command taking `settings: Settings` so it takes every setting as a flag.

    The command's own parameters come first in `--help`; it must not declare a parameter of a
    setting's name (exclude that setting instead, as `tune` does with its `--mtp` list). The
    decorated command's `settings_params` names the parameters that make its Settings.
    """
    skip = set(exclude)

    def decorate(command: Callable[..., Any]) -> Callable[..., Any]:
        signature = inspect.signature(command, eval_str=True)
        own = [p for p in signature.parameters.values() if p.name != "settings"]
        names = setting_names_for(skip)
        clash = {p.name for p in own} & {*names, SETTINGS_FILE}
        if clash:
            raise TypeError(f"{command.__name__} declares setting(s) {sorted(clash)}: exclude")
        generated = [setting_parameter(n) for n in names] + [settings_file_parameter()]
        taken = {*names, SETTINGS_FILE}

        @functools.wraps(command)
        def wrapper(**kwargs: Any) -> Any:
            values = {k: kwargs.pop(k) for k in list(kwargs) if k in taken}
            return command(settings=settings_from(values), **kwargs)

        wrapper.__signature__ = inspect.Signature([*own, *generated])  # type: ignore[attr-defined]
        wrapper.settings_params = frozenset(taken)  # type: ignore[attr-defined]
        wrapper.__annotations__ = {}
        return wrapper

    return decorate
