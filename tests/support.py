"""What tests share besides fixtures (those are in conftest.py): ports, waits, the environment
of a test's genfleet processes, worker and emulator processes, S3 buckets; and what every
fault scenario shares: datasets, stage and wait, process lookups and the exactly-once check
(`assert_exactly_once`: the export holds every input id exactly once, a completion or an
error record, nothing doubled, and no batch marked done in Redis without its output).

Redis: the server on 127.0.0.1:6379 (GENFLEET_TEST_REDIS_URL overrides), one database dedicated
to tests. Workers: `python -m genfleet.workers worker` processes with the emulator, started
through the same supervisor code path as SGLang.
"""

from __future__ import annotations

import collections
import contextlib
import gzip
import hashlib
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import orjson
import redis
from pydantic import SecretStr

from genfleet.common import keys
from genfleet.common.celery_config import REAPER_TASK
from genfleet.common.manifest import BatchEntry, Manifest, write_manifest
from genfleet.common.records import (
    CompletionRecord,
    GenerationParams,
    PromptRecord,
    Usage,
    batch_digest,
    decode_jsonl_gz,
    dumps_jsonl,
    encode_jsonl_gz,
    line_digests,
)
from genfleet.common.redis_conn import text
from genfleet.common.settings import Settings
from genfleet.common.store import Store, open_store
from genfleet.producer.batching import make_batches
from genfleet.producer.enqueue import EnqueueResult, enqueue_run, reader_options
from genfleet.producer.export import ExportResult, export_run
from genfleet.producer.status import run_status

ROOT = Path(__file__).resolve().parent.parent
TEST_REDIS_URL = os.environ.get("GENFLEET_TEST_REDIS_URL", "redis://127.0.0.1:6379/11")


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def wait_for(
    condition: Callable[[], Any], timeout_s: float, what: str, interval_s: float = 0.1
) -> Any:
    """Poll `condition` until it returns a truthy value; fail naming `what` at the deadline."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = condition()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s:.0f} s waiting for {what}")
        time.sleep(interval_s)


def dummy_aws_credentials() -> None:
    os.environ.setdefault("AWS_ACCESS_KEY_ID", "testing")
    os.environ.setdefault("AWS_SECRET_ACCESS_KEY", "testing")
    os.environ.setdefault("AWS_DEFAULT_REGION", "us-east-1")


def new_bucket(endpoint_url: str) -> str:
    """A fresh bucket on the server; returns its store URL, `s3://BUCKET/runs`."""
    import boto3

    bucket = f"genfleet-{uuid.uuid4().hex[:12]}"
    client = boto3.client("s3", endpoint_url=endpoint_url, region_name="us-east-1")
    client.create_bucket(Bucket=bucket)
    return f"s3://{bucket}/runs"


def base_env(redis_url: str, store: str, **extra: Any) -> dict[str, str]:
    """The environment of a test's genfleet processes: fast emulator, short leases."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("GENFLEET_")}
    env.update(
        {
            "GENFLEET_REDIS_URL": redis_url,
            "GENFLEET_STORE": store,
            "GENFLEET_EMULATOR_TIME_SCALE": "200",
            "GENFLEET_EMULATOR_LOAD_S": "0.2",
            "GENFLEET_EMULATOR_WARMUP_S": "0.2",
            "GENFLEET_EMULATOR_MEAN_COMPLETION_TOKENS": "200",
            "GENFLEET_EMULATOR_MAX_COMPLETION_TOKENS": "1024",
            "GENFLEET_MAX_TOKENS": "1024",
            "GENFLEET_STARTUP_TIMEOUT_S": "60",
            "GENFLEET_RESTART_BACKOFF_S": "0.2",
            # a test's workers stop within seconds, handing unfinished batches back
            "GENFLEET_SHUTDOWN_GRACE_S": "1",
            "PYTHONPATH": str(ROOT),
        }
    )
    env.update({f"GENFLEET_{k.upper()}": str(v) for k, v in extra.items()})
    return env


@contextlib.contextmanager
def control_app(broker_url: str) -> Iterator[Any]:
    """A bare Celery app on `broker_url` for remote control (ping, inspect) of test workers."""
    from celery import Celery

    app = Celery("genfleet-test", broker=broker_url, set_as_current=False)
    app.conf.broker_connection_retry_on_startup = True
    try:
        yield app
    finally:
        app.close()


def answering(broker_url: str, hostnames: list[str], timeout_s: float = 0.5) -> set[str]:
    """Which of the Celery workers `hostnames` answer a ping on `broker_url` now.

    A genfleet worker answers only once it consumes, and it consumes only after its engine
    step started the engine and the engine served (the consumer is the last worker step), so
    an answer means ready.
    """
    with control_app(broker_url) as app:
        replies = app.control.ping(destination=hostnames, timeout=timeout_s)
    return {name for reply in replies for name in reply} & set(hostnames)


def worker_report(broker_url: str, hostname: str, timeout_s: float = 1.0) -> dict[str, Any]:
    """Worker `hostname`'s `gpu_report` inspect reply now (its telemetry window, its engine
    state, its recent findings); {} when it does not answer."""
    with control_app(broker_url) as app:
        inspect = app.control.inspect(destination=[hostname], timeout=timeout_s)
        replies = inspect._request("gpu_report") or {}
    report: dict[str, Any] = replies.get(hostname) or {}
    return report


def engine_report(broker_url: str, hostname: str, timeout_s: float = 1.0) -> dict[str, Any]:
    """The engine state (`EngineState` JSON) worker `hostname` reports now; {} when it does
    not answer or has no sample yet."""
    engine: dict[str, Any] = worker_report(broker_url, hostname, timeout_s).get("engine") or {}
    return engine


class Worker:
    """A real `python -m genfleet.workers worker` process (with its emulator engine)."""

    def __init__(self, env: dict[str, str], log: Path, hostname: str, args: list[str]) -> None:
        self.hostname = hostname
        self.log = log
        self.broker_url = env["GENFLEET_REDIS_URL"]
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "genfleet.workers", *args, "--hostname", hostname],
            env=env,
            cwd=ROOT,
            stdout=log.open("ab"),
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )

    def wait_ready(self, timeout_s: float = 60.0) -> None:
        def ready() -> bool:
            if self.proc.poll() is not None:
                raise AssertionError(f"worker exited {self.proc.returncode}:\n{self.tail()}")
            return self.hostname in answering(self.broker_url, [self.hostname])

        wait_for(ready, timeout_s, f"worker {self.hostname} to be ready", 0.2)

    def tail(self, lines: int = 40) -> str:
        return "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:])

    def kill(self, sig: int = signal.SIGKILL) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.kill(self.proc.pid, sig)

    def stop(self, timeout_s: float = 30.0) -> None:
        if self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.proc.pid, signal.SIGKILL)  # whatever is left of the worker's group


EMULATOR_FAST_ENV = {
    "GENFLEET_EMULATOR_LOAD_S": "0",
    "GENFLEET_EMULATOR_WARMUP_S": "0",
    "GENFLEET_EMULATOR_TIME_SCALE": "100",
    "GENFLEET_EMULATOR_MEAN_COMPLETION_TOKENS": "40",
}


@dataclass
class Emulator:
    proc: subprocess.Popen[bytes]
    port: int
    log_path: Path

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def log(self) -> str:
        return self.log_path.read_text()

    def health_status(self) -> int | None:
        """The /health status code, or None while the port is closed."""
        try:
            return httpx.get(f"{self.base_url}/health", timeout=5).status_code
        except httpx.TransportError:
            return None

    def wait_ready(self, timeout_s: float = 15.0) -> None:
        wait_for(lambda: self.health_status() == 200, timeout_s, "/health 200")


StartEmulator = Callable[..., Emulator]


def corrupt_parquet(path: Path, rows: int, group_rows: int, bad_group: int) -> Path:
    """A Parquet file of `rows` prompts whose row group `bad_group` has its data pages
    overwritten (a file corrupt mid-file)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    table = pa.Table.from_pylist(
        [{"id": f"p{i:04d}", "prompt": f"question number {i} " * 5} for i in range(rows)]
    )
    pq.write_table(table, path, row_group_size=group_rows)
    data = bytearray(path.read_bytes())
    for column in range(2):
        offset = pq.ParquetFile(path).metadata.row_group(bad_group).column(column).data_page_offset
        data[offset : offset + 40] = b"\xff" * 40
    path.write_bytes(bytes(data))
    return path


def write_prompts(
    path: Path, count: int, marked: dict[int, str] | None = None, prefix: str = "p"
) -> list[str]:
    """`count` short chat prompts; `marked[i]` replaces the i-th prompt's text. Returns ids."""
    ids = [f"{prefix}{i:05d}" for i in range(count)]
    with path.open("wb") as handle:
        for i, prompt_id in enumerate(ids):
            text = (marked or {}).get(i, f"Question {i}: what is {i} + {i}?")
            row = {"id": prompt_id, "messages": [{"role": "user", "content": text}]}
            handle.write(orjson.dumps(row) + b"\n")
    return ids


def fault_settings(redis_url: str, store: str, **overrides: Any) -> Settings:
    """The producer side's settings; batches small enough that a run has several."""
    values: dict[str, Any] = {"batch_size": 25, "max_tokens": 1024}
    values.update(overrides)
    return Settings(redis_url=SecretStr(redis_url), store=store, **values)


def stage(settings: Settings, run: str, source: Path) -> EnqueueResult:
    return enqueue_run(settings, run, str(source), reader_options(settings))


def open_run_store(settings: Settings) -> Store:
    return open_store(settings.store, settings.s3_endpoint_url, settings.s3_region)


def outputs(store: Store, run: str) -> set[str]:
    """Batches whose output object exists: what "done" means."""
    return {keys.batch_from_output_key(k) for k in store.list(keys.outputs_prefix(run))}


def assert_counters_backed(client: redis.Redis, store: Store, run: str) -> None:
    """Redis's counters follow the store, never lead it: the completion tokens and errors it
    counted are at most what the output objects hold (read after the counters, so a batch
    counted between the two reads is already in the store)."""
    counters = {text(k): int(float(v)) for k, v in client.hgetall(keys.counters_key(run)).items()}
    tokens = errors = 0
    for key in store.list(keys.outputs_prefix(run)):
        for row in decode_jsonl_gz(store.get(key) or b""):
            if row.get("error"):
                errors += 1
            else:
                tokens += int((row.get("usage") or {}).get("completion_tokens") or 0)
    assert counters.get("completion_tokens", 0) <= tokens, (counters, tokens)
    assert counters.get("errors", 0) <= errors, (counters, errors)


def wait_run_done(
    settings: Settings, client: redis.Redis, run: str, timeout_s: float, store: Store | None = None
) -> float:
    """Wait for every batch of `run` to have its output; returns how long that took (s)."""
    objects = store or open_run_store(settings)
    started = time.monotonic()
    wait_for(
        lambda: run_status(objects, client, run)["state"] == "done",
        timeout_s,
        f"run {run} to finish",
        0.25,
    )
    return time.monotonic() - started


def assert_exactly_once(
    settings: Settings,
    run: str,
    input_ids: list[str],
    client: redis.Redis | None = None,
    store: Store | None = None,
) -> tuple[ExportResult, list[dict[str, Any]]]:
    """Export `run` and check that nothing was lost, doubled or marked done early.

    Every input id appears exactly once, either as a completion (content, no error) or as an
    error record (type and message); the output objects themselves hold no repeated id (the
    export would hide one, so its duplicate count must be zero); every batch of the manifest
    has its output, and Redis's counters count nothing the outputs do not hold.
    """
    objects = store or open_run_store(settings)
    target = Path(os.environ.get("TMPDIR", "/tmp")) / f"genfleet-fault-{run}-{os.getpid()}.jsonl"
    try:
        result = export_run(settings, run, str(target), "jsonl", partial=False)
        rows = [orjson.loads(line) for line in target.read_bytes().splitlines()]
    finally:
        target.unlink(missing_ok=True)
    counts = collections.Counter(row["id"] for row in rows)
    doubled = sorted(i for i, n in counts.items() if n > 1)
    assert not doubled, f"ids exported more than once: {doubled[:10]}"
    assert result.duplicates == 0, f"{result.duplicates} duplicate records in output objects"
    missing = sorted(set(input_ids) - set(counts))
    assert not missing, f"{len(missing)} input ids missing from the export: {missing[:10]}"
    extra = sorted(set(counts) - set(input_ids))
    assert not extra, f"ids in the export that were never input: {extra[:10]}"
    assert len(rows) == len(input_ids)
    for row in rows:
        if row["error"] is None:
            assert row["content"] is not None, f"{row['id']}: no content and no error"
        else:
            assert row["error"].get("type") and row["error"].get("message"), row["error"]
    manifest = Manifest.load(objects, run)
    assert manifest is not None
    assert outputs(objects, run) >= set(manifest.batch_ids())
    if client is not None:
        assert_counters_backed(client, objects, run)
    return result, rows


class CommandLog:
    """Every command a Redis server runs while the log is open (`MONITOR`), for a test that
    counts what a pass costs. Open it on a server of the test's own (`private_redis`):
    MONITOR sees every client of the server.

        with CommandLog(server.client()) as log:
            ...
        log.count("HGETALL unacked")
    """

    def __init__(self, client: redis.Redis) -> None:
        self.client = client
        self.commands: list[str] = []
        self._end = f"genfleet-command-log-end-{uuid.uuid4().hex}"
        self._monitor = client.monitor()  # type: ignore[no-untyped-call]
        self._thread = threading.Thread(target=self._read, name="command-log", daemon=True)

    def __enter__(self) -> CommandLog:
        self._monitor.__enter__()
        self._thread.start()
        return self

    def _read(self) -> None:
        while True:
            command = str(self._monitor.next_command()["command"])
            if self._end in command:
                return
            self.commands.append(command)

    def __exit__(self, *exc: object) -> None:
        self.client.echo(self._end)
        self._thread.join(timeout=30)
        self._monitor.__exit__()
        assert not self._thread.is_alive(), "the command log never saw its end"

    def count(self, prefix: str) -> int:
        """Commands that begin with `prefix` (the command's name in any case, then its
        arguments as sent)."""
        name, _, rest = prefix.partition(" ")
        return sum(
            1
            for command in self.commands
            if command.split(" ", 1)[0].upper() == name.upper()
            and (command + " ").partition(" ")[2].startswith(rest)
        )


def pid_alive(pid: int) -> bool:
    """True while `pid` exists and is not a zombie."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def child_pids(pid: int) -> list[int]:
    """Direct children of `pid`, by parent pid in /proc/*/stat (no /proc children files here)."""
    found: list[int] = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        with contextlib.suppress(OSError, IndexError, ValueError):
            fields = stat.read_text().rsplit(")", 1)[1].split()
            if int(fields[1]) == pid:
                found.append(int(stat.parent.name))
    return sorted(found)


def engine_pid(worker: Worker) -> int | None:
    """The pid of the worker's emulator engine, or None while it has none."""
    for pid in child_pids(worker.proc.pid):
        with contextlib.suppress(OSError):
            if b"genfleet.workers.engine.emulator" in Path(f"/proc/{pid}/cmdline").read_bytes():
                if pid_alive(pid):
                    return pid
    return None


def leases_of(client: redis.Redis, run: str, hostname: str) -> set[str]:
    """Batches of `run` whose lease `hostname` holds right now (it is running them)."""
    held = set()
    for key in client.scan_iter(match=keys.lease_key(run, "*")):
        if client.get(key) == hostname.encode():
            held.add(key.decode().rsplit(":", 1)[1])
    return held


def reaped(client: redis.Redis, run: str) -> list[str]:
    """Batches of `run` the lease reaper re-enqueued, from its task results in the result
    backend (one entry per re-enqueue)."""
    found: list[str] = []
    for key in client.scan_iter(match="celery-task-meta-*", count=500):
        meta = orjson.loads(client.get(key) or b"{}")
        if meta.get("name") != REAPER_TASK or meta.get("status") != "SUCCESS":
            continue
        found += [field for field in meta["result"]["requeued"] if field.startswith(f"{run}/")]
    return found


def log_count(worker: Worker, text: str) -> int:
    return worker.log.read_text(errors="replace").count(text)


# --- runs written straight into a store, as enqueue and the workers leave them (export, report)


# The staging id of the runs the tests write straight into a store.
STAGING_ID = "5ca1ab1e"


def stage_prompts(
    store: Store, run: str, prompts: list[PromptRecord], batch_size: int, shard_batches: int = 3
) -> Manifest:
    """What enqueue leaves in the store: one input object per batch (its content hash in the
    manifest, as staging records it) and the manifest (in shards of `shard_batches`, a few
    so that readers cross shards)."""
    entries = []
    for index, records in enumerate(make_batches(prompts, batch_size, 10**12, 16)):
        batch = keys.batch_id(index)
        key = keys.input_key(run, batch)
        raw = dumps_jsonl(r.to_json() for r in records)
        store.put(key, gzip.compress(raw, mtime=0))
        sha256 = batch_digest(line_digests(raw))
        entries.append(BatchEntry(batch=batch, key=key, prompts=len(records), sha256=sha256))
    return write_manifest(
        store,
        run,
        STAGING_ID,
        entries,
        shard_batches,
        source="test",
        format="jsonl",
        fingerprint="f",
        created_at=1_700_000_000.0,
        params=GenerationParams(max_tokens=16, temperature=0.6, top_p=0.95, thinking=True),
        model="test-model",
        engine="emulator",
        prompts_total=len(prompts),
        rejects=0,
    )


def completion(prompt: PromptRecord, run: str, batch: str) -> dict[str, Any]:
    """A plausible worker output for `prompt`; ids ending in `!` become error records."""
    failed = prompt.id.endswith("!")
    return CompletionRecord(
        id=prompt.id,
        run=run,
        batch=batch,
        messages=prompt.messages,
        reasoning=None if failed else f"thinking about {prompt.id}",
        content=None if failed else f"answer to {prompt.id}",
        finish_reason=None if failed else "stop",
        usage=Usage(10, 0 if failed else 20, 0 if failed else 5),
        model="test-model",
        engine={"kind": "emulator", "worker": "w1"},
        latency_s=0.5,
        error={"type": "context_length", "message": "too long"} if failed else None,
        sample=prompt.sample,
        custom_id=prompt.custom_id,
        request_id=None if failed else f"r-{prompt.id}-{prompt.sample}",
    ).to_json()


def finish(
    store: Store, manifest: Manifest, skip: frozenset[str] = frozenset(), repeat: int = 1
) -> None:
    """Write every batch's output object (each line `repeat` times), except those in `skip`."""
    for entry in manifest.entries(store):
        if entry.batch in skip:
            continue
        staged = store.get(entry.key) or b""
        prompts = [PromptRecord.from_json(d) for d in decode_jsonl_gz(staged)]
        digests = line_sha256s(gzip.decompress(staged))
        rows = [
            {**completion(p, manifest.run, entry.batch), "prompt_sha256": digest}
            for p, digest in zip(prompts, digests, strict=True)
            for _ in range(repeat)
        ]
        assert store.put_if_absent(
            keys.output_key(manifest.run, entry.batch), encode_jsonl_gz(rows)
        )


def line_sha256s(raw: bytes) -> list[str]:
    """What an output row names as its prompt: the sha256 of the prompt's staged line."""
    return [hashlib.sha256(line).hexdigest() for line in raw.splitlines()]


def prompts(n: int) -> list[PromptRecord]:
    return [PromptRecord(f"p{i:04d}", [{"role": "user", "content": f"q{i}"}]) for i in range(n)]


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    data = path.read_bytes()
    if path.name.endswith(".gz"):
        data = gzip.decompress(data)
    return [orjson.loads(line) for line in data.splitlines()]
