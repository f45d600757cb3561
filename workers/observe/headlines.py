"""The lines a person reads: a finished batch and a power-watch round, each in a few words.

Task results carry these lines first, under `summary`, and the full figures after them, so
Flower's Tasks page (through `flower_format_task`, set up by `workers/observe/flower.py`)
shows `run/batch-000004: 30 prompts, 43,586 tok, 4,407 tok/s in 33 s, accept 2.6, gpu@vm
GPU 0` and `1 of 1 GPU underused: client_limited; fleet 5,164 tok/s` instead of a dict of
600 characters, while the result backend, Flower's API and `genfleet findings --json` keep
every number.

Everything here is pure. The lines never hold a quote or a backslash, so that the repr of a
result (what Flower receives from the worker) can be read back without a parser."""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from typing import Any

from genfleet.common.quality import QualityTally, shares
from genfleet.common.waste import WasteTally

# The knob to turn, per cause, in a few words (diagnosis.py holds the long suggestion).
FIXES = {
    "crash_loop": "a restart will not fix it",
    "restart_budget_spent": "not taking work until its cool-down ends",
    "engine_down": "read the engine log",
    "mtp_off": "run with MTP on",
    "mtp_ineffective": "check the checkpoint's MTP weights (genfleet preflight)",
    "engine_capped": "raise --max-running-requests",
    "client_limited": "raise --max-inflight",
    "starved": "nothing queued: enqueue more or run fewer workers",
    "worker_unresponsive": "check its process, broker and engine",
}


def plural(count: int, word: str, many: str | None = None) -> str:
    """`1 batch`, `3 batches`, `1,024 prompts`."""
    if count == 1:
        return f"1 {word}"
    return f"{count:,} {many or word + 's'}"


def clock(seconds: float) -> str:
    """h:mm:ss, the one format of ETAs and long durations: 75 → 0:01:15."""
    minutes, secs = divmod(max(int(round(seconds)), 0), 60)
    hours, minutes = divmod(minutes, 60)
    return f"{hours}:{minutes:02d}:{secs:02d}"


def duration(seconds: float) -> str:
    """`33 s` under a minute, h:mm:ss above."""
    return f"{seconds:.0f} s" if seconds < 59.5 else clock(seconds)


def _clean(text: str) -> str:
    return text.replace("'", "").replace('"', "").replace("\\", "/")


def waiting_work(queue_depth: int, active_batches: int) -> str:
    """What waits for a GPU: `4 orders queued`, or, when the queue reads 0 because the
    worker reserved them, `3 batches reserved by this worker`."""
    if queue_depth or not active_batches:
        return f"{plural(queue_depth, 'order')} queued"
    return f"{plural(active_batches, 'batch', 'batches')} reserved by this worker"


def gpu_label(gpus: str | None) -> str:
    """The CUDA devices of a worker: `GPU 0`, `GPUs 0,1`, or nothing when it saw them all."""
    if not gpus:
        return ""
    return f"GPU {gpus}" if "," not in gpus else f"GPUs {gpus}"


def batch_headline(summary: Mapping[str, Any]) -> str:
    """One line for a finished batch, e.g.
    `run/batch-000004: 30 prompts, 43,586 tok, 4,407 tok/s in 33 s, accept 2.6, gpu@vm GPU 0`,
    with `kept 81%, 2 loops stopped (61,440 tok saved)` when some tokens will not be kept.
    """
    where = f"{summary.get('run')}/{summary.get('batch')}"
    worker = " ".join(p for p in (summary.get("worker") or "", gpu_label(summary.get("gpus"))) if p)
    if summary.get("skipped"):
        return _clean(f"{where}: already done (its output exists), {worker}".rstrip(", "))
    parts = [
        plural(int(summary.get("prompts") or 0), "prompt"),
        f"{int(summary.get('completion_tokens') or 0):,} tok",
        f"{float(summary.get('tokens_per_s') or 0):,.0f} tok/s in "
        f"{duration(float(summary.get('duration_s') or 0))}",
    ]
    if summary.get("accept_length") is not None:
        parts.append(f"accept {float(summary['accept_length']):.1f}")
    if summary.get("errors"):
        parts.append(plural(int(summary["errors"]), "error record"))
    if waste := waste_words(summary.get("waste") or {}):
        parts.append(waste)
    if answers := answer_words(summary.get("quality") or {}):
        parts.append(answers)
    if summary.get("resumed"):
        parts.append(f"{int(summary['resumed']):,} from a checkpoint")
    if summary.get("duplicate"):
        parts.append("another copy wrote the output first")
    if worker:
        parts.append(worker)
    return _clean(f"{where}: {', '.join(parts)}")


def answer_words(counters: Mapping[str, Any]) -> str:
    """A batch's answers that will not be kept, from its quality counters
    (common/quality.py): `answers 4% kept, 96% empty, 100% cut`; '' when all were kept."""
    tally = QualityTally.from_counters(counters)
    if not tally.answers or tally.counts["kept"] == tally.answers:
        return ""
    share = shares(tally)
    words = [f"answers {share['kept']:.0%} kept"]
    words += [f"{share[k]:.0%} {w}" for k, w in (("empty", "empty"), ("length", "cut")) if share[k]]
    return ", ".join(words)


def waste_words(counters: Mapping[str, Any]) -> str:
    """A batch's tokens that will not be kept, from its waste counters (common/waste.py):
    `kept 81%, 2 loops stopped (61,440 tok saved)`; '' when every token was kept."""
    tally = WasteTally.from_counters(counters).figures()
    generated = tally["generated_tokens"]
    if not generated or tally["tokens"]["kept"] == generated:
        return ""
    words = [f"kept {tally['tokens_share']['kept']:.0%}"]
    if tally["loops_stopped"]:
        words.append(
            f"{plural(tally['loops_stopped'], 'loop')} stopped "
            f"({tally['tokens_saved']:,} tok saved)"
        )
    return ", ".join(words)


def not_generated_headline(result: Mapping[str, Any]) -> str:
    """One line for a work order a worker took and did not generate (`lifecycle.gate`, a
    cancel mid-batch): `run/batch-000004: the run is cancelled: parked`."""
    where = f"{result.get('run')}/{result.get('batch')}"
    if result.get("refused"):
        return _clean(
            f"{where}: this worker does not serve the run's model: handed back to "
            f"{result.get('queue')} ({result.get('refused')})"
        )
    if result.get("handed_back"):
        return _clean(f"{where}: an order for another model: handed back to {result.get('queue')}")
    if result.get("superseded"):
        return _clean(f"{where}: an order of a staging the run no longer has: dropped")
    if result.get("drop"):
        return _clean(f"{where}: its run was deleted: dropped")
    return _clean(f"{where}: the run is cancelled: parked (enqueue --resume resumes it)")


def short_gpu(uuid: str | None) -> str:
    """`GPU-8f3a…` from a full NVML UUID (the first block is enough to tell GPUs apart)."""
    if not uuid:
        return ""
    head = uuid.split("-")
    if len(head) > 2 and len(uuid) > 16:
        return f"{head[0]}-{head[1][:8]}…"
    return uuid


def finding_line(finding: Mapping[str, Any]) -> str:
    """`gpu@vm GPU-8f3a…: 20 % of 700 W, client_limited — raise --max-inflight`."""
    who = " ".join(p for p in (str(finding.get("worker")), short_gpu(finding.get("gpu_uuid"))) if p)
    cause = str(finding.get("cause"))
    if cause == "worker_unresponsive":
        return _clean(f"{who}: not answering — {FIXES[cause]}")
    numbers = finding.get("numbers") or {}
    power, limit = numbers.get("power_w"), numbers.get("power_limit_w")
    facts = []
    if power is not None and limit:
        facts.append(f"{100 * power / limit:.0f} % of {limit:.0f} W")
    if cause == "mtp_ineffective" and numbers.get("accept_length") is not None:
        facts.append(f"accept {numbers['accept_length']:.2f}")
    if cause in ("crash_loop", "restart_budget_spent"):
        return _clean(f"{who}: {engine_alarm_line(cause, numbers)}")
    fix = FIXES.get(cause, "")
    if cause == "engine_capped" and numbers.get("cap_fix"):
        fix = capped_fix(numbers)
    if cause == "client_limited" and not numbers.get("queue_depth"):
        # The queue reads 0 because this worker reserved the batches: say what waits.
        batches = int(numbers.get("active_batches") or 0)
        verb = "waits" if batches == 1 else "wait"
        fix = (
            f"{waiting_work(0, batches)} {verb} with {numbers.get('inflight')}/"
            f"{numbers.get('inflight_cap')} in flight: {fix}"
        )
    facts.append(f"{cause} — {fix}" if fix else cause)
    return _clean(f"{who}: {', '.join(facts)}")


_CAP_WORDS = {"state_pool": "the recurrent-state pool", "kv": "the KV cache"}


def capped_fix(numbers: Mapping[str, Any]) -> str:
    """The short fix of an `engine_capped` finding, naming what caps the engine:
    `the recurrent-state pool caps it at 12: --disable-radix-cache …`, `the KV cache admits
    no more: …` (it queues below its cap), `raise --max-running-requests to 48`."""
    limit, fix = numbers.get("cap_limit"), str(numbers.get("cap_fix") or FIXES["engine_capped"])
    words = _CAP_WORDS.get(str(limit))
    if words is None:
        return fix
    running, cap = numbers.get("running"), numbers.get("max_running_requests")
    if running is not None and cap is not None and running < cap:
        return f"{words} admits no more: {fix}"
    return f"{words} caps it at {cap}: {fix}"


def engine_alarm_line(cause: str, numbers: Mapping[str, Any]) -> str:
    """An engine that needs a person, in one line: `crash loop (3 times): RuntimeError: … —
    --disable-cuda-graph avoids it …` or `restart budget spent (5 in 3600 s), back in 540 s:
    RuntimeError: …`."""
    error = str(numbers.get("crash_error") or "no error in its log")[:160]
    fix = str(numbers.get("crash_fix") or FIXES[cause])
    if cause == "crash_loop":
        return f"crash loop ({numbers.get('crash_repeats')} times): {error} — {fix}"
    return (
        f"restart budget spent ({numbers.get('restarts_in_window')} in "
        f"{numbers.get('restart_window')}), back in {numbers.get('cooldown_left')}: {error}"
        + (f" — {fix}" if numbers.get("crash_known") else "")
    )


def watch_headlines(
    rows: Sequence[Mapping[str, Any]], findings: Sequence[Mapping[str, Any]]
) -> str:
    """A power-watch round: one line for the fleet (`fleet 12,100 tok/s; 0 of 2 GPUs
    underused`, the alarm first when there is one), then one line per finding, e.g.

        1 of 1 GPU underused: client_limited; fleet 5,164 tok/s
        gpu@vm GPU-8f3a…: 20 % of 700 W, client_limited — raise --max-inflight

    `rows` are the verdict rows (one per GPU, `diagnosis.verdicts`), `findings` the round's
    findings as JSON.
    """
    gpus = [r for r in rows if r.get("verdict") != "unresponsive"]
    rate = sum(float(r.get("tokens_per_s") or 0) for r in gpus)
    underused = sum(1 for r in gpus if r.get("verdict") == "underused")
    share = f"{underused} of {plural(len(gpus), 'GPU')} underused"
    head = f"fleet {rate:,.0f} tok/s; {share}"
    causes = [str(f.get("cause")) for f in findings if f.get("verdict") == "underused"]
    if causes:
        # The alarm and its cause first: Flower's Result cell shows about 50 characters.
        head = f"{share}: {', '.join(dict.fromkeys(causes))}; fleet {rate:,.0f} tok/s"
    if not rows:
        head = "fleet: no GPU worker answered"
    return "\n".join([_clean(head), *(finding_line(f) for f in findings)])


_SUMMARY = re.compile(r"^\{'summary': '([^'\\]*)'", re.DOTALL)


def summary_of(result_repr: object) -> str | None:
    """The `summary` line(s) at the head of a result's repr (what Flower holds), or None."""
    if not isinstance(result_repr, str):
        return None
    match = _SUMMARY.match(result_repr)
    return match.group(1) if match else None


def flower_format_task(task: Any) -> Any:
    """Flower's `format_task` hook: a genfleet result shows as its summary, lines joined by
    ` | ` (the Tasks table keeps a cell on one line)."""
    text = summary_of(getattr(task, "result", None))
    if text is not None:
        task.result = " | ".join(text.splitlines())
    return task
