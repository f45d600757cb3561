"""The producer's commands: enqueue, status, export, report, retry and the all-in-one run."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Annotated, Any

import orjson
import redis
import typer
from rich.markup import escape
from rich.progress import BarColumn, Progress, TextColumn

from genfleet.common import keys
from genfleet.common.errors import GenfleetError
from genfleet.common.flags import with_settings
from genfleet.common.ledger import Ledger
from genfleet.common.manifest import Manifest
from genfleet.common.quality import quality_text
from genfleet.common.redis_conn import connect
from genfleet.common.routing import ModelRef, work_queue
from genfleet.common.settings import Settings
from genfleet.common.store import Store, store_of
from genfleet.common.waste import waste_text
from genfleet.producer.console import (
    AnswerCol,
    FirstTurn,
    Json,
    RedisUrl,
    S3Endpoint,
    StoreUrl,
    SystemCol,
    build_settings,
    console,
    fail,
    format_eta,
    out,
    plural,
    print_read_as,
    print_rejects,
    warn_unread,
)
from genfleet.producer.enqueue import (
    EnqueueResult,
    enqueue_run,
    generation_params,
    reader_options,
    regenerate_advice,
    without_previous_text,
)
from genfleet.producer.runs.identity import check_resumed
from genfleet.producer.status import (
    energy_text,
    engine_alarm_text,
    loading_workers,
    read_findings,
    run_is_held,
    run_status,
    stall_facts,
    stall_reason,
    unconsumed_queue,
    wait_deadline_s,
)

# A run still this long is checked for a queue that no live worker consumes.
QUEUE_CHECK_S = 5.0

QueueCheck = Callable[[dict[str, Any]], dict[str, Any] | None]

Run = Annotated[str, typer.Option("--run", help="run name: letters, digits, . _ -")]
GpuHourCost = Annotated[
    float | None,
    typer.Option("--gpu-hour-cost", help="USD per GPU-hour: cost per million tokens"),
]
Format = Annotated[
    str | None, typer.Option("--format", help="jsonl|openai|parquet|hf (default: from the path)")
]


@with_settings(exclude={"role"})
def enqueue(
    settings: Settings,
    source: Annotated[str | None, typer.Argument(help="dataset file or directory")] = None,
    run: Run = "",
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
    resume: Annotated[
        bool, typer.Option("--resume", help="rebuild the queue of RUN from the store alone")
    ] = False,
    json_out: Json = False,
) -> None:
    """Stage SOURCE as RUN in the store and enqueue one work order per batch.

    Re-running it for a run that exists enqueues only batches without output (nothing, when
    the run is done). `--resume RUN` does that without a SOURCE, e.g. after Redis lost all.
    The run goes to its model's queue (`--model`, `--engine`): the one its workers consume.
    """
    if resume and not run and source:
        run, source = source, None  # `genfleet enqueue --resume RUN`
    if not run:
        fail("--run RUN is required")
    if source is None and not resume:
        fail("give a SOURCE to stage, or --resume RUN to re-enqueue from the store")
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
        result = enqueue_run(settings, run, None if resume else source, options, verify=resume)
    except (GenfleetError, ValueError) as exc:
        fail(str(exc))
    unconsumed = None
    if result.batches_enqueued or result.batches_done < result.batches_total:
        unconsumed = queue_check(settings)({"model": result.model, "engine": result.engine})
    _print_enqueue(result, json_out, unconsumed)


def queue_check(settings: Settings) -> QueueCheck:
    """A check, given a run's status (its `model` and `engine`), of whether a live worker
    consumes the run's queue: None when one does (or the workers could not be asked), else
    what `unconsumed_queue` says. Each call asks the workers (it waits INSPECT_TIMEOUT_S) and
    reads which are still loading their engine."""
    from genfleet.producer.broker import make_client_app, worker_queues

    def check(report: dict[str, Any]) -> dict[str, Any] | None:
        model, engine = report.get("model"), report.get("engine")
        if model is None or engine is None:
            return None
        queue = work_queue(settings.queue, ModelRef(engine, model))
        # Loading first: one that starts consuming during the broadcast's wait is in one.
        with connect(settings, check=False, timeout_s=5.0) as client:
            loading = loading_workers(client, settings.summary_ttl_s)
        app = make_client_app(settings)
        try:
            consumers = worker_queues(app)
        finally:
            app.close()
        refused = {
            str(worker): str(entry.get("why"))
            for worker, entry in (report.get("model_refusals") or {}).items()
        }
        return unconsumed_queue(queue, model, engine, settings.queue, consumers, loading, refused)

    return check


def warn_unconsumed(run: str, unconsumed: dict[str, Any] | None) -> None:
    """The loud line on stderr for a run whose queue no live worker consumes."""
    if unconsumed is not None:
        console.print(f"[bold red]warning:[/] run {run}: {escape(unconsumed['message'])}")


def _print_enqueue(
    result: EnqueueResult, json_out: bool, unconsumed: dict[str, Any] | None = None
) -> None:
    if json_out:  # the warning is the JSON's `unconsumed`
        out.print_json(orjson.dumps({**result.to_json(), "unconsumed": unconsumed}).decode())
        return
    warn_unconsumed(result.run, unconsumed)
    verb = "staged" if result.staged else "found"
    console.print(
        f"run [bold]{result.run}[/]: {verb} {plural(result.prompts, 'prompt')} in "
        f"{plural(result.batches_total, 'batch', 'batches')}; enqueued "
        f"{result.batches_enqueued}, already done {result.batches_done}, rejected "
        f"{plural(result.rejects, 'line')}; model {result.model} (queue {result.queue})"
        + (
            "; it was paused by the quality gate and is resumed"
            if result.unpaused
            else "; it was cancelled and is resumed"
            if result.uncancelled
            else ""
        )
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
    warn_unread(result.run, result.sources_unread, result.rows_unread)
    if result.rejects > len(result.reject_samples):
        console.print(f"  … all {result.rejects} rejects are in {result.run}/rejects.jsonl")
    if result.without_previous:
        note = without_previous_text(result.without_previous, result.prompts)
        console.print(f"  [yellow]{escape(note)}[/]", highlight=False)
    if result.ends_with_answer:
        advice = regenerate_advice(result.ends_with_answer)
        console.print(f"  [yellow]{escape(advice)}[/] (as a new run: --run NEW)", highlight=False)


def status(
    run: Annotated[str, typer.Argument()],
    json_out: Json = False,
    watch: Annotated[bool, typer.Option("--watch", help="a live progress bar")] = False,
    redis_url: RedisUrl = None,
    store: StoreUrl = None,
    s3_endpoint_url: S3Endpoint = None,
    gpu_hour_cost: GpuHourCost = None,
    verify: Annotated[
        bool, typer.Option("--verify", help="list the store's outputs first (O(batches))")
    ] = False,
) -> None:
    """Progress of RUN: batches and prompts done, failed batches, tok/s, ETA, energy.

    Read from Redis's progress copy whatever the run's size; `--verify` lists the store's
    outputs (the truth) first and repairs the copy from them."""
    settings = build_settings(
        redis_url=redis_url,
        store=store,
        s3_endpoint_url=s3_endpoint_url,
        gpu_hour_cost=gpu_hour_cost,
    )
    try:
        objects = store_of(settings)
        client = connect(settings)
        check = queue_check(settings)
        if watch:
            stall_s = settings.engine_stall_timeout_s
            deadline_s = wait_deadline_s(settings)
            watch_run(
                objects,
                client,
                run,
                None,
                stall_s,
                settings.queue,
                check,
                deadline_s,
                settings.summary_ttl_s,
                settings.progress_interval_s,
            )
        report = run_status(
            objects,
            client,
            run,
            gpu_hour_cost=settings.gpu_hour_cost,
            queue_prefix=settings.queue,
            verify=verify,
        )
        report["unconsumed"] = None
        if report["state"] in {"queued", "running"}:
            report["unconsumed"] = check(report)
    except WaitExpired as exc:
        fail(str(exc), 1)
    except (GenfleetError, ValueError) as exc:
        fail(str(exc))
    if json_out:  # the warning is the JSON's `unconsumed`
        out.print_json(orjson.dumps(report).decode())
        return
    warn_unconsumed(run, report["unconsumed"])
    out.print(status_line(report), highlight=False)
    warn_unread(run, report["sources_unread"], report["rows_unread"])
    for batch, error in report["failed"].items():
        out.print(f"  failed {batch}: {escape(error)}", highlight=False)
    if report["batches_failed"] > len(report["failed"]):
        out.print(f"  … and {report['batches_failed'] - len(report['failed']):,} more failed")
    for alarm in report["engine_alarms"]:
        out.print(f"  engine {escape(engine_alarm_text(alarm, time.time()))}", highlight=False)
    for worker, refusal in report["model_refusals"].items():
        why = escape(str(refusal.get("why")))
        out.print(f"  {escape(worker)} refuses the run's model: {why}", highlight=False)
    if energy := energy_text(report):
        out.print(f"  energy: {energy}", highlight=False)
    if waste := waste_text(report.get("waste") or {}):
        out.print(f"  {waste}", highlight=False)
    if report.get("paused"):
        out.print(f"  {escape(paused_text(report))}", highlight=False)


def paused_text(report: dict[str, Any]) -> str:
    """Why the quality gate paused the run, the fix, and how to go on."""
    run, verdict = report["run"], report["paused"]
    change = (
        f"--change-params --max-tokens {verdict['suggested_max_tokens']} for the rest, or "
        if verdict.get("suggested_max_tokens")
        else "--change-params with other parameters for the rest, or "
    )
    return (
        f"paused by the quality gate: {verdict['message']}. Go on with "
        f"`genfleet enqueue --resume {run}` (a fleet) or `genfleet run` again (this machine): "
        f"{change}--no-quality-gate to keep these answers coming"
    )


def status_line(report: dict[str, Any]) -> str:
    """`run: running — batches 3/10 done, 0 failed; prompts 60/200; 43,586 tokens; 4,407
    tok/s; ETA 0:01:15`; a finished run gives its mean pace and how long it took."""
    head = (
        f"{report['run']}: {report['state']} — batches {report['batches_done']:,}/"
        f"{report['batches_total']:,} done, {report['batches_failed']:,} failed; prompts "
        f"{report['prompts_done']:,}/{report['prompts_total']:,}; "
        f"{plural(report['completion_tokens'], 'token')}; "
    )
    if report["state"] in {"done", "failed"} and report.get("duration_s"):
        line = head + (
            f"mean {report['tokens_per_s']:,.0f} tok/s over {format_eta(report['duration_s'])}"
        )
    else:
        line = head + f"{report['tokens_per_s']:,.0f} tok/s; ETA {format_eta(report['eta_s'])}"
    return line + quality_tail(report)


def quality_tail(report: dict[str, Any]) -> str:
    """`; answers: 7.4% kept, 92.6% empty, …; last 200: 5.0% kept` ('' before any answer):
    the run so far, then the gate's window where it differs from the run so far."""
    found = report.get("quality") or {}
    so_far, window = found.get("so_far") or {}, found.get("window") or {}
    text = quality_text(so_far)
    if not text:
        return ""
    if window.get("answers") and window["answers"] < so_far["answers"]:
        text += f"; last {window['answers']:,}: {window['shares']['kept']:.1%} kept"
    return "; " + text


def watch_run(
    objects: Store,
    client: redis.Redis,
    run: str,
    check: Callable[[], None] | None = None,
    stall_s: float = 300.0,
    queue: str = "gpu",
    queue_check: QueueCheck | None = None,
    deadline_s: float | None = None,
    summary_ttl_s: float | None = None,
    line_interval_s: float | None = None,
) -> None:
    """A progress bar with tok/s and ETA until the run is done or failed; where the output is
    no terminal (piped, nohup, CI), a status line every `line_interval_s` instead, since a
    bar that redraws in place prints nothing there. When nothing has
    moved (prompts answered, batches done or failed) for `stall_s`, it says so and why, once
    per still spell. Sooner, after QUEUE_CHECK_S still, `queue_check` asks whether a live
    worker consumes the run's queue and, when none does, says so at once.

    With `deadline_s`, it gives up (WaitExpired, saying why) once nothing has moved and no
    worker has held a batch of the run for that long: a deadline that follows the work, not
    the run's size. With `summary_ttl_s` (the workers' summaries' TTL), the why names the
    workers still loading their engine for the run."""
    with Progress(
        TextColumn("[bold]{task.fields[run]}"),
        BarColumn(),
        TextColumn("{task.completed}/{task.total} prompts"),
        TextColumn("{task.fields[rate]} tok/s"),
        TextColumn("ETA {task.fields[eta]}"),
        TextColumn("{task.fields[kept]}"),
        console=console,
    ) as progress:
        task = progress.add_task("run", total=None, run=run, rate=0, eta="-", kept="")
        lines = line_interval_s if line_interval_s and not progress.console.is_terminal else None
        lined_at = -float("inf")
        moved_at, last, warned, asked = time.monotonic(), None, False, False
        worked_at = moved_at
        unconsumed: dict[str, Any] | None = None
        while True:
            report = run_status(objects, client, run)
            figures = (
                report["prompts_generated"],
                report["batches_done"],
                report["batches_failed"],
            )
            if figures != last:
                moved_at, last, warned, asked = time.monotonic(), figures, False, False
                unconsumed = None
            still_s = time.monotonic() - moved_at
            waiting = report["state"] in {"queued", "running"}
            if deadline_s is not None and waiting:
                if run_is_held(client, run):
                    worked_at = time.monotonic()
                worked_at = max(worked_at, moved_at)
                if time.monotonic() - worked_at >= deadline_s:
                    facts = stall_facts(client, run, _run_queue(queue, report), summary_ttl_s)
                    reason = stall_reason(
                        report, still_s=still_s, now=time.time(), unconsumed=unconsumed, **facts
                    )
                    raise WaitExpired(
                        f"{run}: stopped waiting after {deadline_s:.0f} s in which no prompt "
                        f"finished and no worker held a batch of it ({reason}); the run goes "
                        f"on when work comes back: `genfleet status {run} --watch`"
                    )
            if queue_check and waiting and still_s >= min(stall_s or QUEUE_CHECK_S, QUEUE_CHECK_S):
                if not asked or (stall_s and still_s >= stall_s and not warned):
                    unconsumed = queue_check(report)
                # A worker loading its engine does not answer yet: that is said at stall_s.
                if unconsumed is not None and unconsumed["workers_answering"] and not asked:
                    progress.console.print(
                        f"[bold red]{run}: {escape(unconsumed['message'])}[/]", highlight=False
                    )
                asked = True
            if stall_s and still_s >= stall_s and not warned:
                facts = stall_facts(client, run, _run_queue(queue, report), summary_ttl_s)
                reason = stall_reason(
                    report, still_s=still_s, now=time.time(), unconsumed=unconsumed, **facts
                )
                progress.console.print(f"[yellow]{run}: {reason}[/]", highlight=False)
                warned = True
            progress.update(
                task,
                total=report["prompts_total"],
                completed=report["prompts_generated"],
                rate=report["tokens_per_s"],
                eta=format_eta(report["eta_s"]),
                kept=kept_column(report),
            )
            if lines is not None and time.monotonic() - lined_at >= lines:
                lined_at = time.monotonic()
                # One line each, however long: a log is read line by line.
                line = escape(status_line(report))
                progress.console.print(line, highlight=False, soft_wrap=True)
            if report["state"] in {"done", "failed", "cancelled", "paused"}:
                return
            if check is not None:
                check()
            time.sleep(1.0)


def kept_column(report: dict[str, Any]) -> str:
    """The bar's quality column: `kept 92.6% (cut 2.1%)`, '' before any answer."""
    so_far = (report.get("quality") or {}).get("so_far") or {}
    if not so_far.get("answers"):
        return ""
    share = so_far["shares"]
    return f"kept {share['kept']:.1%} (empty {share['empty']:.1%}, cut {share['length']:.1%})"


class WaitExpired(GenfleetError):
    """A wait on a run gave up: nothing moved and nothing held its batches for too long."""


def _run_queue(prefix: str, report: dict[str, Any]) -> str:
    """The run's work queue (`gpu.emulator`, `gpu.<model>`); the bare prefix for a run that
    recorded no model."""
    if report.get("model") is None or report.get("engine") is None:
        return prefix
    return work_queue(prefix, ModelRef(report["engine"], report["model"]))


def retry(
    run: Annotated[str, typer.Argument()],
    errors: Annotated[bool, typer.Option("--errors", help="regenerate the error records")] = False,
    stopped: Annotated[
        bool,
        typer.Option("--stopped", help='regenerate the answers the guard stopped ("repetition")'),
    ] = False,
    cut: Annotated[
        bool, typer.Option("--cut", help='regenerate the answers cut at max_tokens ("length")')
    ] = False,
    max_tokens: Annotated[
        int | None, typer.Option("--max-tokens", help="the retried records' max_tokens")
    ] = None,
    repetition_guard: Annotated[
        bool,
        typer.Option(
            "--repetition-guard/--no-repetition-guard",
            help="watch the retried answers for loops",
        ),
    ] = True,
    json_out: Json = False,
    redis_url: RedisUrl = None,
    store: StoreUrl = None,
    s3_endpoint_url: S3Endpoint = None,
) -> None:
    """Re-enqueue RUN's failed batches (and any batch without output and without an order);
    with --errors, --stopped, --cut: regenerate just those records, as a new retry round
    (outputs stay write-once; export and report take each record's newest accepted answer)."""
    from genfleet.producer.runs.retries import resend_rounds, retry_records

    settings = build_settings(redis_url=redis_url, store=store, s3_endpoint_url=s3_endpoint_url)
    kinds = {name for name, on in (("errors", errors), ("stopped", stopped), ("cut", cut)) if on}
    if not kinds and (max_tokens is not None or not repetition_guard):
        fail("--max-tokens and --no-repetition-guard go with --errors, --stopped or --cut")
    if kinds:
        try:
            found = retry_records(settings, run, kinds, max_tokens, repetition_guard)
        except (GenfleetError, ValueError) as exc:
            fail(str(exc))
        if json_out:
            out.print_json(orjson.dumps(found.to_json()).decode())
            return
        if not found.round:
            console.print(
                f"run {run}: no record to retry ({', '.join(found.kinds)})", highlight=False
            )
            return
        shown = ", ".join(f"{count} {kind}" for kind, count in sorted(found.by_kind.items()))
        changed = ", ".join(f"{k}={v}" for k, v in found.params.items()) or "none"
        console.print(
            f"run {run}: retry {found.round}: {plural(found.records, 'record')} ({shown}) "
            f"staged as {found.retry_run} in {plural(found.batches_enqueued, 'batch', 'batches')}"
            f" (parameters changed: {changed}); follow it with `genfleet status "
            f"{found.retry_run}`; export and report take the new answers as they come",
            highlight=False,
        )
        return
    try:
        keys.validate_run(run)  # before any key is built from it
        manifest = Manifest.load(store_of(settings), run)
        if manifest is not None:  # before the failed set is cleared: a refusal touches nothing
            check_resumed(manifest, settings, generation_params(settings))
        failed = Ledger(connect(settings)).clear_failed(run)
        result = enqueue_run(settings, run, None, reader_options(settings), verify=True)
        rounds = resend_rounds(settings, run)
    except (GenfleetError, ValueError) as exc:
        fail(str(exc))
    resent = sum(found.batches_enqueued for found in rounds)
    console.print(
        f"run {run}: {plural(len(failed), 'failed batch', 'failed batches')} cleared; enqueued "
        f"{result.batches_enqueued}; {result.batches_done}/{result.batches_total} done"
        + (f"; {resent} batches of its retry rounds sent again" if resent else ""),
        highlight=False,
    )


def export(
    run: Annotated[str, typer.Argument()],
    out_path: Annotated[str, typer.Option("--out", help="local path or s3://bucket/key")],
    fmt: Annotated[str, typer.Option("--format", help="jsonl|parquet|openai")] = "jsonl",
    partial: Annotated[bool, typer.Option("--partial", help="export what is done")] = False,
    shard_size: Annotated[
        int | None, typer.Option("--shard-size", help="N records per file: OUT-00000.jsonl, …")
    ] = None,
    previous: Annotated[
        bool, typer.Option("--previous/--no-previous", help="keep --regenerate's old answers")
    ] = True,
    redis_url: RedisUrl = None,
    store: StoreUrl = None,
    s3_endpoint_url: S3Endpoint = None,
    with_stopped: Annotated[
        bool,
        typer.Option("--with-stopped", help="keep the text of loops the guard stopped"),
    ] = False,
) -> None:
    """Write RUN's completions to one file (or numbered shards), deduplicated, in input order:
    one row per prompt (a retried one's newest accepted answer); error and cut rows as they
    are; rows the repetition guard stopped without the loop's text unless --with-stopped."""
    from genfleet.producer.export import export_run

    settings = build_settings(redis_url=redis_url, store=store, s3_endpoint_url=s3_endpoint_url)
    try:
        result = export_run(
            settings, run, out_path, fmt, partial, shard_size, previous, with_stopped=with_stopped
        )
    except (GenfleetError, ValueError) as exc:
        fail(str(exc))
    missing = len(result.missing_batches)
    target = result.path
    if shard_size is not None:
        target = f"{len(result.shards)} shards" + (
            f" ({result.shards[0]} … {result.shards[-1]})" if result.shards else ""
        )
    console.print(
        f"run {run}: exported {result.records} records ({result.errors} error records) from "
        f"{result.batches_exported}/{result.batches_total} batches to {target} "
        f"({result.format})"
        + (f"; {plural(missing, 'batch', 'batches')} not done yet" if missing else "")
        + f"; {export_counts(result)}",
        highlight=False,
    )


def export_counts(result: Any) -> str:
    """The export rule's counts: `3 cut at max_tokens, 2 stopped (loop text left out:
    --with-stopped keeps it), 1 error; 4 retried (3 answered by a retry, 2 kept)`."""
    stopped = f"{result.stopped} stopped by the repetition guard"
    if result.stopped_left_out:
        stopped += " (loop text left out: --with-stopped keeps it)"
    text = f"{result.cut} cut at max_tokens, {stopped}, {result.errors} error rows"
    if result.retried:
        text += (
            f"; {plural(result.retried, 'record')} retried ({result.retried_replaced} answered "
            f"by a retry, {result.retried_kept} of them kept)"
        )
    if result.retries_pending:
        text += f"; {result.retries_pending} retry batches not done yet (originals stand)"
    return text


def report(
    run: Annotated[str, typer.Argument()],
    json_out: Json = False,
    store: StoreUrl = None,
    s3_endpoint_url: S3Endpoint = None,
    redis_url: RedisUrl = None,
    gpu_hour_cost: GpuHourCost = None,
) -> None:
    """Quality of RUN's outputs: token distributions, finish reasons, short answers, flags;
    and what its GPUs spent (kWh, J/token, cost per million tokens with --gpu-hour-cost)."""
    from genfleet.producer.report import build_report, render_report

    settings = build_settings(
        store=store,
        s3_endpoint_url=s3_endpoint_url,
        redis_url=redis_url,
        gpu_hour_cost=gpu_hour_cost,
    )
    try:
        data = build_report(settings, run)
    except (GenfleetError, ValueError) as exc:
        fail(str(exc))
    if json_out:
        out.print_json(orjson.dumps(data).decode())
    else:
        out.print(render_report(data))


def findings(
    run: Annotated[str | None, typer.Option("--run", help="only this run's")] = None,
    json_out: Json = False,
    redis_url: RedisUrl = None,
) -> None:
    """Recent power-watch findings: underused GPUs with their cause, numbers and a fix."""
    settings = build_settings(redis_url=redis_url)
    try:
        items = read_findings(connect(settings), run)
    except (GenfleetError, ValueError) as exc:
        fail(str(exc))
    if json_out:
        out.print_json(orjson.dumps(items).decode())
        return
    if not items:
        out.print("no findings")
    for item in items:
        when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(item.get("ts", 0)))
        out.print(
            f"{when} {item.get('worker')} {item.get('gpu_uuid') or ''} {item.get('verdict')}: "
            f"{item.get('cause')} — {item.get('suggestion')}",
            highlight=False,
        )
