"""Every store key and Redis key genfleet uses, with the reason for each.

The store (S3 or a local directory) is the source of truth: a run is its manifest, its staged
inputs and its outputs. Redis carries work orders and live telemetry only; losing it loses
nothing that `genfleet enqueue --resume` cannot rebuild from the store.
"""

from __future__ import annotations

import re

# Run names become key prefixes in S3 and Redis: letters, digits, '.', '_' and '-', starting
# with a letter or digit, so no `../`, no slash, no glob or key-separator injection.
_RUN_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")
_BATCH_RE = re.compile(r"^batch-\d{6,}$")
_STAGING_RE = re.compile(r"^[0-9a-f]{1,64}$")  # a claim's staging id: secrets.token_hex


def validate_run(run: str) -> str:
    """Return `run` when it is a safe run name, else raise ValueError saying why."""
    if not run:
        raise ValueError("run name is empty")
    if ".." in run or not _RUN_RE.match(run):
        raise ValueError(
            f"run name {run!r} is not allowed: use 1-128 letters, digits, '.', '_' or '-', "
            "starting with a letter or digit, and no '..'"
        )
    return run


def validate_batch(batch: str) -> str:
    if not _BATCH_RE.match(batch):
        raise ValueError(f"batch id {batch!r} is not of the form batch-NNNNNN")
    return batch


def batch_id(index: int) -> str:
    """Deterministic id of the index-th batch of a run (input order)."""
    return f"batch-{index:06d}"


def batch_index(batch: str) -> int:
    return int(validate_batch(batch).split("-", 1)[1])


# --- store keys (relative to the store's prefix) ---------------------------------------------


def manifest_key(run: str) -> str:
    """What the run is: source, settings, and the index of its batch list's shards (each
    one's content hash). Written last by the staging: its existence means staging finished.
    (A run staged before shards holds its whole batch list here: read whole, as before.)"""
    return f"{run}/manifest.json"


def manifest_shard_key(run: str, staging_id: str, shard: int) -> str:
    """Entries `shard * shard_batches` onwards of the run's batch list, written once by the
    staging it names before the index that lists its hash: a reader of one batch's entry
    (the lost-order reconciler) reads one shard, a resume streams them. Named by staging, so
    the shards of a staging that an interrupted delete left behind never meet a new one's."""
    if not _STAGING_RE.match(staging_id):
        raise ValueError(f"staging id {staging_id!r} is not a hex token")
    return f"{run}/manifest/{staging_id}/shard-{shard:06d}.json"


def claim_key(run: str) -> str:
    """The model, parameters and batching a run is staged with, written before its first
    batch: an interrupted staging is resumed only with the same ones."""
    return f"{run}/claim.json"


def model_key(run: str) -> str:
    """The model the run asks for (common/model_identity.py), written once by the producer as it
    stages the run, before its first order: a worker serving another hands the run's orders
    back. Runs staged by an older genfleet hold the fingerprint of their first worker here."""
    return f"{run}/model.json"


def input_key(run: str, batch: str) -> str:
    """A staged batch of prompts (claim check: work orders carry this key, not prompts)."""
    return f"{run}/inputs/{batch}.jsonl.gz"


def output_key(run: str, batch: str) -> str:
    """A batch's completions, write-once: its existence means the batch is done."""
    return f"{run}/outputs/{batch}.jsonl.gz"


def params_change_key(run: str, number: int) -> str:
    """A change of the run's generation parameters for the batches not yet done
    (`--change-params`), write-once, numbered in order: the manifest read applies them."""
    return f"{run}/params-changes/{number:06d}.json"


def retry_round_key(run: str, number: int) -> str:
    """A retry round of the run (`genfleet retry RUN --errors/--stopped/--cut`), write-once,
    numbered from 1 in order: which records it regenerates, with which changed parameters,
    and the run that holds its batches (`retry_run`). Export and report read the rounds in
    order until one is missing and take each record's newest accepted answer."""
    return f"{run}/retries/{number:06d}.json"


def retry_run(run: str, number: int) -> str:
    """The run that holds retry round `number` of `run`: staged, sent and generated like any
    run (its own inputs, write-once outputs, orders, leases), so a retry is exactly-once the
    same way; the round object in `run` binds it to `run`'s staging. ValueError when the
    name would be too long."""
    return validate_run(f"{run}.retry-{number:06d}")


def outputs_prefix(run: str) -> str:
    return f"{run}/outputs/"


def part_key(run: str, batch: str, part: int) -> str:
    """A checkpoint of a running batch: completions flushed so a retry skips them."""
    return f"{run}/parts/{batch}/part-{part:05d}.jsonl.gz"


def parts_prefix(run: str, batch: str) -> str:
    return f"{run}/parts/{batch}/"


def part_number(key: str) -> int:
    """The number of a part from its key (`part_key`)."""
    name = key.rsplit("/", 1)[-1]
    if not (name.startswith("part-") and name.endswith(".jsonl.gz")):
        raise ValueError(f"not a checkpoint part's key: {key!r}")
    return int(name[len("part-") : -len(".jsonl.gz")])


def response_format_key(run: str, sha256: str) -> str:
    """The run's `response_format` (`--json-schema`), stored once by its content hash: work
    orders carry this key and the hash, not the schema (schema × batches in Redis)."""
    return f"{run}/params/response_format-{sha256[:16]}.json"


def rejects_key(run: str) -> str:
    """Input lines that were refused, with file, line, field and reason."""
    return f"{run}/rejects.jsonl"


def batch_from_output_key(key: str) -> str:
    name = key.rsplit("/", 1)[-1]
    return name.removesuffix(".jsonl.gz")


# --- Redis keys ------------------------------------------------------------------------------

# The broker's own keys (kombu's Redis transport): one list per priority step of a queue, and
# the hash of delivered but unacknowledged messages.
PRIORITY_SEP = "\x06\x16"
PRIORITY_STEPS = (0, 3, 6, 9)
UNACKED = "unacked"
UNACKED_INDEX = "unacked_index"  # delivery time of each unacknowledged message


def broker_queue_keys(queue: str) -> list[str]:
    """The Redis lists holding `queue`'s waiting messages, one per priority step."""
    return [queue if step == 0 else f"{queue}{PRIORITY_SEP}{step}" for step in PRIORITY_STEPS]


def broker_queue_key(queue: str, priority: object) -> str:
    """The list of `queue` a message of `priority` (its `properties.priority`, as kombu reads
    it: 0 to 9, anything else 0) waits in: the step at or below it.

    >>> [broker_queue_key("q", p) for p in (None, 0, 2, 3, 9, 12)] == ["q"] * 3 + [
    ...     "q\x06\x163", "q\x06\x169", "q\x06\x169"]
    True
    """
    try:
        level = max(min(int(priority), 9), 0)  # type: ignore[call-overload]
    except (TypeError, ValueError):
        level = 0
    step = max(s for s in PRIORITY_STEPS if s <= level)
    return broker_queue_keys(queue)[PRIORITY_STEPS.index(step)]


PREFIX = "genfleet"


def runs_key() -> str:
    """Set of run names seen by this Redis (for `top` and the power-watch); no TTL."""
    return f"{PREFIX}:runs"


def counters_key(run: str) -> str:
    """Hash of live counters (started_at, completion_tokens, errors, prompts_generated, ...)."""
    return f"{PREFIX}:run:{run}:counters"


def done_key(run: str) -> str:
    """Hash batch → prompts of the batches whose output object exists, written by the worker
    that confirmed it and repaired from the store's listing (common/progress.py): `status`
    reads its length instead of listing the outputs."""
    return f"{PREFIX}:run:{run}:done"


def summary_key(run: str) -> str:
    """Hash: the manifest's summary (batches and prompts total, model, engine) and when the
    done hash was last reconciled with the store; absent = reconcile before trusting it."""
    return f"{PREFIX}:run:{run}:summary"


def queued_key(run: str) -> str:
    """Set of batches with a work order outstanding, so a re-run does not send it twice."""
    return f"{PREFIX}:run:{run}:queued"


def staging_key(run: str) -> str:
    """When the run's staging started, while its producer stages it; deleted once the manifest
    is written. TTL = STAGING_TTL_S, refreshed as batches are sent, so a producer that died
    stops counting as staging: the power-watch tells a run that is ending (draining) from one
    whose producer is slower than the fleet (starved)."""
    return f"{PREFIX}:run:{run}:staging"


STAGING_TTL_S = 600


def failed_key(run: str) -> str:
    """Hash batch → last error of batches that exhausted their tries; `retry` clears it."""
    return f"{PREFIX}:run:{run}:failed"


def attempts_key(run: str) -> str:
    """Hash batch → tries so far; a batch that reaches the limit goes to the failed set."""
    return f"{PREFIX}:run:{run}:attempts"


def lost_key(run: str) -> str:
    """Hash batch → deliveries that ended with the worker dead or vanished (lease expired, no
    output); at max_deliveries the batch is parked as poison. `retry` clears it."""
    return f"{PREFIX}:run:{run}:lost"


def crash_evidence_key(run: str, batch: str) -> str:
    """Hash prompt (`sample:id`) → the engine's own deaths it was arriving at, on any worker
    (workers/crash_evidence.py): the next worker to run the batch starts from these counts, so
    a prompt that kills engines is blamed however often its batch moves. Counts, no times
    (never compared across hosts' clocks). TTL = CRASH_EVIDENCE_TTL_S, refreshed at each
    death; deleted once the batch's output is written."""
    return f"{PREFIX}:run:{run}:crash_evidence:{batch}"


CRASH_EVIDENCE_TTL_S = 7 * 86400


def drawn_journal_key(run: str, batch: str, attempt: str) -> str:
    """String of JSON lines, one per flush: what the answers in flight of one try (`attempt`:
    a random id per try) of a batch drew since its last checkpoint (workers/drawn_journal.py).
    Deleted by that try at each checkpoint of its answers in flight (the copy holds them),
    every try's at once when the batch's output is written. TTL = DRAWN_JOURNAL_TTL_S,
    refreshed at each flush."""
    return f"{PREFIX}:run:{run}:drawn:{batch}:{attempt}"


def drawn_journal_tries_key(run: str, batch: str) -> str:
    """Hash attempt → what its lines are for (the order's staging and input, `binding`): the
    tries of a batch with a journal (`drawn_journal_key`), read by the next try; the same TTL
    and the same end."""
    return f"{PREFIX}:run:{run}:drawn:{batch}"


DRAWN_JOURNAL_TTL_S = 2 * 86400


def throughput_bucket_key(run: str, bucket: int) -> str:
    """Hash "" → the run's tokens, worker → its tokens, generated in ten-second bucket
    `bucket` (common/throughput.py); expires an hour after."""
    return f"{PREFIX}:run:{run}:throughput:{bucket}"


def model_refusals_key(run: str) -> str:
    """Hash worker → why it does not serve the run's model (JSON), written by a worker as it
    refuses the run and removed by one that serves it (common/model_identity.py): `status`
    says the run's orders are held when every worker of its queue refused it. TTL: twice the
    refusal memory (`refused_run_memory_s`), refreshed at each refusal noted."""
    return f"{PREFIX}:run:{run}:model_refusals"


def cancelled_key(run: str) -> str:
    """Set by `genfleet cancel` (value: when): workers start no batch of the run and stop the
    running ones; the next enqueue of the run clears it. No TTL."""
    return f"{PREFIX}:run:{run}:cancelled"


def deleted_key(run: str) -> str:
    """Tombstone left by `genfleet delete` (value: the staging id it deleted), so that a stray
    work order of that staging is dropped even if a run of the same name is staged again (no
    time in it: comparing it with an order's would compare two hosts' clocks). TTL: the
    visibility timeout, after which no such order can come back."""
    return f"{PREFIX}:deleted:{run}"


def run_keys_pattern(run: str) -> str:
    """Every per-run key above (`genfleet delete` scans it)."""
    return f"{PREFIX}:run:{run}:*"


def leases_pattern(run: str) -> str:
    return f"{PREFIX}:lease:{run}:*"


def work_queues_key() -> str:
    """Set of the per-model work queues orders were sent to (queue depth for the power-watch,
    and where `cancel` and `delete` look for a run's waiting orders); no TTL."""
    return f"{PREFIX}:queues"


def lease_key(run: str, batch: str) -> str:
    """Refreshed by the worker running a batch; TTL = lease_ttl_s. Expired + no output = lost."""
    return f"{PREFIX}:lease:{run}:{batch}"


def running_key() -> str:
    """Hash `run/batch` → enqueue/claim info, scanned by the reaper for batches to re-enqueue."""
    return f"{PREFIX}:running"


def reaping_key() -> str:
    """Held (SET NX, TTL = a lease) by the reaper pass that runs: a slow pass and the next
    beat's must not both take the same batches over. Deleted when the pass ends."""
    return f"{PREFIX}:reaping"


def delivered_key() -> str:
    """Hash delivery tag → the worker a work order was delivered to and its connection's name,
    written as the worker receives it; the reaper gives back to the queue an order its dead
    worker never claimed (workers/observe/liveness.py) and drops the entries kombu no longer
    holds."""
    return f"{PREFIX}:delivered"


def missing_key() -> str:
    """Hash `run/batch` → when the beat first saw that queued batch held by no order (its own
    clock); the reconciler sends it again a lease later. Fields go when the batch reappears."""
    return f"{PREFIX}:missing"


def lapsed_key() -> str:
    """Hash `run/batch` → when the reaper first found that running batch's lease lapsed (the
    beat's own clock); it reaps only on a later look, a heartbeat on, so a lease that lapsed
    while Redis was away and that its live worker re-sets is not taken for a death."""
    return f"{PREFIX}:lapsed"


def findings_key() -> str:
    """Stream of power-watch findings, capped at findings_maxlen entries."""
    return f"{PREFIX}:findings"


def alerted_key() -> str:
    """Hash finding fingerprint → last alert time, so one finding is not re-alerted each beat."""
    return f"{PREFIX}:alerted"


def workers_key() -> str:
    """Hash worker → last time it answered the power-watch; a silent one is a finding."""
    return f"{PREFIX}:workers"


def summaries_key() -> str:
    """Hash worker → its last pushed GPU summary (what `gpu_report` returns), read by the
    power-watch instead of a broadcast; pruned with `pushed_key` (workers/observe/pushed.py).
    Expires FORGET_S after the last push of any worker."""
    return f"{PREFIX}:summaries"


def pushed_key() -> str:
    """Sorted set worker → when it last pushed its summary, by Redis's clock: past the TTL a
    worker is silent (a finding), after FORGET_S it is pruned."""
    return f"{PREFIX}:pushed"


def engine_alarms_key() -> str:
    """Hash worker → JSON of its engine when it needs a person: its restart budget spent (in
    a cool-down, not taking work) or dying the same way on every restart (a crash loop, with
    the error and any known workaround). Written by the worker when that happens, removed
    when its engine serves again or the worker stops; `status` shows the entries of a run's
    queue. No TTL: a worker killed outright leaves its entry until the power-watch forgets the
    silent worker (common/engine_alarms.py)."""
    return f"{PREFIX}:engine-alarms"


def quality_window_key(run: str) -> str:
    """List of the run's last batches' quality tallies, newest first, trimmed to the window
    (common/quality_gate.py): the gate judges the last answers from it, in O(window)."""
    return f"{PREFIX}:run:{run}:quality-window"


def quality_gate_key(run: str) -> str:
    """The quality gate's settings for the run, as the last enqueue of it gave them (JSON;
    common/quality_gate.py). Workers judge the run by these, not by their own settings."""
    return f"{PREFIX}:run:{run}:quality-gate"


def paused_key(run: str) -> str:
    """The quality gate's verdict that paused the run (JSON), set once with the cancelled
    flag; the next enqueue of the run clears both (common/quality_gate.py). No TTL."""
    return f"{PREFIX}:run:{run}:paused"
