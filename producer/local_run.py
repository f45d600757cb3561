"""`genfleet run SOURCE`: the whole job on one machine, from a dataset file to a finished run.

Starts the GPU workers (one per GPU group, each with its engine) and the control worker
(beat: power-watch and lease reaper) as child processes, stages and enqueues the dataset,
shows progress until every prompt has an output or an error record, stops the children and
prints a summary with the power-watch findings. Exit code 0 when the run is done, 1 when
batches failed (then `genfleet retry RUN`) or the quality gate paused the run (the message
says why and what to change; `genfleet run` again resumes it), 2 on a setup error.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Annotated, Any

import orjson
import redis
import typer
from rich.markup import escape

from genfleet.common import keys
from genfleet.common.errors import GenfleetError
from genfleet.common.flags import fail, with_settings
from genfleet.common.manifest import Manifest
from genfleet.common.private import die_with_parent, open_private
from genfleet.common.quality import quality_text
from genfleet.common.redis_conn import connect
from genfleet.common.settings import Settings
from genfleet.common.store import store_of
from genfleet.producer.commands import (
    Format,
    WaitExpired,
    paused_text,
    queue_check,
    watch_run,
)
from genfleet.producer.console import (
    AnswerCol,
    FirstTurn,
    Json,
    SystemCol,
    console,
    format_eta,
    out,
    plural,
    print_read_as,
    print_rejects,
    warn_unread,
)
from genfleet.producer.enqueue import (
    enqueue_run,
    generation_params,
    reader_options,
    regenerate_advice,
    without_previous_text,
)
from genfleet.producer.local_fleet import FleetLock
from genfleet.producer.runs.identity import existing_run
from genfleet.producer.status import read_findings, run_status, wait_deadline_s

COMPRESSED = (".gz", ".zst", ".bz2", ".xz")


def default_run_name(source: str) -> str:
    """The dataset's file name without its extension, made a valid run name: re-running
    resumes the same run (`prompts.v2.jsonl` → `prompts.v2`, `data.jsonl.gz` → `data`).

    Two files of the same name are not the same run: enqueueing the second into the first's
    run is refused (the fingerprints differ), never merged."""
    path = Path(source)
    name = path.name
    if not path.is_dir():
        name = name.removesuffix(next((s for s in COMPRESSED if name.endswith(s)), ""))
        name = str(Path(name).stem) if "." in name.strip(".") else name
    stem = name or "run"
    cleaned = "".join(c if c.isalnum() or c in "._-" else "-" for c in stem).strip(".-_")
    return keys.validate_run(cleaned[:100] or "run")


class Children:
    """The worker processes this run started; stopped together, never left behind: each one
    holds the fleet's lock (`keep_fds`) and gets SIGTERM if this process dies, even by
    SIGKILL."""

    def __init__(self, log_dir: Path, keep_fds: tuple[int, ...] = ()) -> None:
        self.log_dir = log_dir
        self.keep_fds = keep_fds
        self.procs: dict[str, subprocess.Popen[bytes]] = {}

    def start(self, name: str, args: list[str], env: dict[str, str]) -> None:
        fd = open_private(self.log_dir / f"{name}.log", os.O_WRONLY | os.O_APPEND)
        with os.fdopen(fd, "ab") as log:
            self.procs[name] = subprocess.Popen(
                [sys.executable, "-m", "genfleet.workers", *args],
                env=env,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                pass_fds=self.keep_fds,
                preexec_fn=die_with_parent,
            )

    def dead(self) -> dict[str, int]:
        return {n: p.returncode for n, p in self.procs.items() if p.poll() is not None}

    def stop(self, timeout_s: float = 90.0) -> None:
        for proc in self.procs.values():
            if proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGTERM)
        deadline = time.monotonic() + timeout_s
        for proc in self.procs.values():
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=max(deadline - time.monotonic(), 0.1))
            if proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()

    def tail(self, name: str, lines: int = 15) -> str:
        path = self.log_dir / f"{name}.log"
        text = path.read_text(errors="replace") if path.exists() else ""
        return "\n".join(text.splitlines()[-lines:])


def _wait(children: Children, settings: Settings, run: str) -> dict[str, Any]:
    store = store_of(settings)
    client = connect(settings)

    def check() -> None:
        dead = children.dead()
        if "worker" in dead:
            raise GenfleetError(
                f"the worker exited with code {dead['worker']} before the run finished; "
                f"last lines of {children.log_dir}/worker.log:\n{children.tail('worker')}"
            )

    stall_s = settings.engine_stall_timeout_s
    deadline_s = wait_deadline_s(settings)
    watch_run(
        store,
        client,
        run,
        check,
        stall_s,
        settings.queue,
        queue_check(settings),
        deadline_s,
        settings.summary_ttl_s,
        settings.progress_interval_s,
    )
    return run_status(store, client, run)


@with_settings(exclude={"role"})
def run_command(
    settings: Settings,
    source: Annotated[str, typer.Argument(help="dataset file or directory")],
    run: Annotated[str | None, typer.Option("--run", help="default: the file's name")] = None,
    fmt: Format = None,
    messages_col: Annotated[
        str | None, typer.Option(help="field or column (jsonl, parquet, hf)")
    ] = None,
    prompt_col: Annotated[
        str | None, typer.Option(help="field or column (jsonl, parquet, hf)")
    ] = None,
    id_col: Annotated[str | None, typer.Option(help="field or column (jsonl, parquet, hf)")] = None,
    system_col: SystemCol = None,
    answer_col: AnswerCol = None,
    first_turn: FirstTurn = False,
    json_out: Json = False,
) -> None:
    """Generate SOURCE on this machine end to end: workers, engine, enqueue, wait, summary.

    Any setting is a flag: `--model PATH` (SGLang; without it the emulator runs, said loudly),
    `--no-mtp`, `--gpus 0,1`, `--tp-size`, `--batch-size`, `--max-tokens`, `--store`, ...
    The workers it starts get these settings in their environment.
    """
    run = run or default_run_name(source)
    options = reader_options(
        settings,
        fmt,
        messages_col=messages_col,
        prompt_col=prompt_col,
        id_col=id_col,
        system_col=system_col,
        answer_col=answer_col,
        first_turn=first_turn,
    )
    try:
        keys.validate_run(run)
        connect(settings)
    except (GenfleetError, ValueError) as exc:
        fail(str(exc))
    kind = settings.engine_kind
    if kind == "emulator":
        console.print(
            "[bold yellow]ENGINE: the genfleet emulator[/] — no --model given, so outputs are "
            "synthetic (a dry run). Pass --model PATH to run SGLang.",
            highlight=False,
        )
    else:
        console.print(f"ENGINE: {kind} {settings.model or settings.engine_url or ''}")
    if kind == "sglang":
        _preflight(settings)
    try:
        # Before anything starts: a run of this name with other data or settings is refused.
        existing = existing_run(settings, generation_params(settings), run, source, options)
    except (GenfleetError, ValueError) as exc:
        fail(str(exc))
    log_dir = Path(settings.log_dir or tempfile.mkdtemp(prefix="genfleet-run-"))
    log_dir.mkdir(parents=True, exist_ok=True)
    finished = _finished(settings, run) if existing is not None else None
    if finished is not None:  # nothing to generate: no workers, no engine
        console.print(f"run [bold]{run}[/] is already done in {settings.store}", highlight=False)
        _summary(settings, finished, json_out)
        raise typer.Exit(0)
    settings = settings.model_copy(update={"log_dir": str(log_dir)})
    env = {**os.environ, **settings.child_env()}
    try:
        lock = FleetLock.take(log_dir)
    except GenfleetError as exc:
        fail(str(exc))
    children = Children(log_dir, keep_fds=(lock.fd,))
    console.print(f"store {settings.store}; logs in {log_dir}", highlight=False)
    previous_term = signal.signal(signal.SIGTERM, _interrupt)
    try:
        children.start("worker", ["worker"], env)
        children.start("control", ["control"], env)
        # An existing run (checked above) only gets orders for what it lacks.
        result = enqueue_run(settings, run, None if existing else source, options)
        console.print(
            f"run [bold]{run}[/]: {plural(result.prompts, 'prompt')}, "
            f"{plural(result.batches_total, 'batch', 'batches')} ({result.batches_done} already "
            f"done), {plural(result.rejects, 'line')} rejected"
            + (
                "; the batches not yet done go on with "
                + ", ".join(f"{k}={v}" for k, v in result.params_changed.items())
                if result.params_changed
                else ""
            ),
            highlight=False,
        )
        print_read_as(result.read_as)
        print_rejects(result.reject_samples)
        warn_unread(run, result.sources_unread, result.rows_unread)
        if result.without_previous:
            note = without_previous_text(result.without_previous, result.prompts)
            console.print(f"  {note}", highlight=False)
        if result.ends_with_answer:
            console.print(f"  {regenerate_advice(result.ends_with_answer)}", highlight=False)
        report = _wait(children, settings, run)
    except WaitExpired as exc:
        fail(str(exc), 1)
    except (GenfleetError, ValueError) as exc:
        fail(str(exc))
    except redis.RedisError as exc:
        fail(f"Redis failed ({exc}); the workers are stopped, finished batches are kept")
    except KeyboardInterrupt:
        console.print("interrupted: stopping workers (finished batches are kept)")
        raise typer.Exit(130) from None
    finally:
        # Whatever ended the wait (an error of any kind, Ctrl-C, SIGTERM): stop the fleet.
        children.stop()
        lock.release()
        signal.signal(signal.SIGTERM, previous_term)
    _summary(settings, report, json_out)
    raise typer.Exit(0 if report["state"] == "done" else 1)


def _interrupt(signum: int, frame: object) -> None:
    """SIGTERM (`kill`, a service manager) ends the wait as Ctrl-C does: the fleet stops."""
    raise KeyboardInterrupt


def _finished(settings: Settings, run: str) -> dict[str, Any] | None:
    """The run's status if it was staged before and every batch has its output, else None."""
    store = store_of(settings)
    if Manifest.load(store, run) is None:
        return None
    report = run_status(store, connect(settings), run)
    return report if report["state"] == "done" else None


def _preflight(settings: Settings) -> None:
    """Check the checkpoint before starting anything (the GPU side runs the check)."""
    check = subprocess.run(
        [sys.executable, "-m", "genfleet.workers", "preflight"],
        env={**os.environ, **settings.child_env()},
        capture_output=True,
        text=True,
        check=False,
    )
    if check.returncode != 0:
        fail(check.stderr.strip().removeprefix("error: ") or "preflight failed")
    for line in check.stdout.splitlines():
        console.print(f"preflight: {line}", highlight=False)


def _summary(settings: Settings, report: dict[str, Any], json_out: bool) -> None:
    findings = _findings(settings, report["run"])
    if json_out:
        out.print_json(orjson.dumps({**report, "findings": findings}).decode())
        return
    out.print(
        f"run {report['run']}: {report['state']} — {report['prompts_done']:,}/"
        f"{plural(report['prompts_total'], 'prompt')} "
        f"({plural(report['errors'], 'error record')}"
        + (f"; {answers}" if (answers := quality_text(report["quality"]["so_far"])) else "")
        + "), "
        f"{plural(report['completion_tokens'], 'completion token')}"
        + (
            f" in {format_eta(report['duration_s'])} ({report['mean_tokens_per_s']:,.0f} tok/s)"
            if report.get("duration_s")
            else ""
        )
        + f", {plural(report['batches_failed'], 'failed batch', 'failed batches')}",
        highlight=False,
    )
    if report["state"] == "paused":
        console.print(f"[bold red]{escape(paused_text(report))}[/]", highlight=False)
    elif report["state"] == "cancelled":
        out.print(f"cancelled; resume with `genfleet enqueue --resume {report['run']}`")
    elif report["state"] != "done":
        out.print(f"failed batches: {', '.join(report['failed'])}; fix, then `genfleet retry`")
    out.print(f"export: genfleet export {report['run']} --out {report['run']}.jsonl")
    # The end of a run (GPUs draining) is not a finding, so every finding here is news.
    for finding in findings:
        out.print(
            f"finding: {finding.get('worker')} {finding.get('cause')}: {finding.get('suggestion')}",
            highlight=False,
        )


def _findings(settings: Settings, run: str) -> list[dict[str, Any]]:
    """Power-watch findings recorded while this run was going (from the Redis stream)."""
    try:
        return read_findings(connect(settings), run)[:20]
    except Exception:  # noqa: BLE001 - a summary never fails on telemetry
        return []
