"""What tests share besides fixtures (those are in conftest.py): ports, waits, the environment
of a test's genfleet processes, the root command (as a process, in process, a background
`genfleet run`), worker and emulator processes, S3 buckets; what every fault scenario shares:
datasets, stage and wait (until a batch runs, until the run is done), process lookups and the
exactly-once check (`assert_exactly_once`: the export holds every input id exactly once, a
completion or an error record, nothing doubled, and no batch marked done in Redis without its
output); one batch in process on the fakes (the core tests); the compose file as Compose reads
it; datasets and S3 sources for the readers.

Redis: the server on 127.0.0.1:6379, one database dedicated to tests (11, or the one
GENFLEET_TEST_REDIS_URL names; one per xdist worker in a parallel run: `redis_url_for_tests`).
Workers: `python -m genfleet.workers worker` processes with the emulator, started through the
same supervisor code path as SGLang.
"""

from __future__ import annotations

import collections
import contextlib
import gzip
import hashlib
import os
import re
import shlex
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.parse
import uuid
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import httpx
import orjson
import redis
import yaml
from pydantic import SecretStr

from genfleet.common import keys
from genfleet.common.celery_config import REAPER_TASK
from genfleet.common.ledger import running_field
from genfleet.common.manifest import BatchEntry, Manifest, write_manifest
from genfleet.common.readers import ReaderOptions, Reject
from genfleet.common.records import (
    CompletionRecord,
    GenerationParams,
    PromptRecord,
    Usage,
    WorkOrder,
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
from genfleet.workers.batch import BatchSummary, execute
from genfleet.workers.feeding.feeder import Feeder
from tests.fakes.memory_redis import MemoryRedis
from tests.fakes.runtime import FakeRuntime

if TYPE_CHECKING:
    import pyarrow as pa

ROOT = Path(__file__).resolve().parent.parent


def xdist_index() -> int | None:
    """This pytest-xdist worker's number (`gw3` → 3), or None outside a parallel run."""
    worker = os.environ.get("PYTEST_XDIST_WORKER", "")
    return int(worker[2:]) if worker.startswith("gw") and worker[2:].isdigit() else None


def redis_url_for_tests() -> str:
    """The Redis database of this test process, flushed before and after each test that uses it.

    GENFLEET_TEST_REDIS_URL names it (default database 11). In a parallel run each xdist worker
    gets a database of its own, `gwN` the Nth after the first: the named one, or 12 by default,
    so that a serial run (11) and a parallel one on the same machine never flush each other's.
    """
    named = os.environ.get("GENFLEET_TEST_REDIS_URL")
    index = xdist_index()
    if index is None:
        return named or "redis://127.0.0.1:6379/11"
    base = urllib.parse.urlsplit(named or "redis://127.0.0.1:6379/12")
    first = int(base.path.strip("/") or 0)
    return urllib.parse.urlunsplit(base._replace(path=f"/{first + index}"))


TEST_REDIS_URL = redis_url_for_tests()


def engine_port_base() -> int:
    """Where this test process's engines start looking for a port: SGLang's 30000, 1000 on
    per xdist worker (port locks are per private directory, and each xdist worker has its
    own: conftest.py)."""
    return 30000 + 1000 * (xdist_index() or 0)


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


def meanwhile(
    ready: Callable[[], Any], action: Callable[[], None], what: str
) -> Callable[[], None]:
    """Run `action` on a thread of its own once `ready()` holds (10 s at most, `what` names
    it); returns the join, which re-raises what the thread raised."""
    raised: list[BaseException] = []

    def run() -> None:
        try:
            wait_for(ready, 10, what, 0.01)
            action()
        except BaseException as exc:  # handed to the test's own thread by join()
            raised.append(exc)

    thread = threading.Thread(target=run, name="meanwhile")
    thread.start()

    def join() -> None:
        thread.join(timeout=10)
        if raised:
            raise raised[0]

    return join


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
    if xdist_index() is not None:
        env["GENFLEET_PORT"] = str(engine_port_base())
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


# The root `genfleet` command: its entry point (`genfleet.cli:main`) on this interpreter.
GENFLEET = [sys.executable, "-c", "from genfleet.cli import main; main()"]


def genfleet(
    args: list[str], env: dict[str, str] | None = None, timeout_s: float = 240
) -> subprocess.CompletedProcess[str]:
    """`genfleet ARGS…` run to its end, output captured (in this process's environment
    unless `env` is given)."""
    return subprocess.run(
        [*GENFLEET, *args],
        env=env,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=timeout_s,
        check=False,
    )


def invoke(*args: str, env: dict[str, str] | None = None) -> Any:
    """The root `genfleet` command in this process (typer's CliRunner); returns its Result.

    Its terminal is 400 columns wide: at rich's default 80 a long path (a test's tmp_path
    under xdist) wraps mid-name and no longer reads as one word.
    """
    from typer.testing import CliRunner

    from genfleet.cli import app

    return CliRunner().invoke(app, list(args), env={"COLUMNS": "400", **(env or {})})


def consuming(hostname: str) -> list[str] | None:
    """The queues `hostname` consumes from, or None while it does not answer."""
    from genfleet.workers.app import app as worker_app

    replies: dict[str, Any] = (
        worker_app.control.inspect([hostname], timeout=1.0).active_queues() or {}
    )
    queues = replies.get(hostname)
    return None if queues is None else [q["name"] for q in queues]


def processes_with_env(needle: str) -> list[int]:
    """Pids of live processes whose environment holds `needle` (this test's store URL)."""
    found = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            if needle.encode() in (proc / "environ").read_bytes():
                found.append(int(proc.name))
        except OSError:
            continue
    return found


class BackgroundRun:
    """`genfleet run SOURCE --batch-size 20` started in the background, as a user leaves it
    running: a slow emulator (time scale 1), its logs and its own TMPDIR (so its run lock)
    under `directory`, its store `directory/store`, stdout and stderr in `directory/run.out`.
    `stop()` kills what is left of it."""

    def __init__(self, redis_url: str, directory: Path, source: Path) -> None:
        self.store = (directory / "store").as_uri()
        self.env = {
            **base_env(redis_url, self.store, emulator_time_scale=1, log_dir=directory / "logs"),
            "TMPDIR": str(directory),
        }
        self.output = directory / "run.out"
        self.proc = subprocess.Popen(
            [*GENFLEET, "run", str(source), "--batch-size", "20"],
            env=self.env,
            cwd=ROOT,
            stdout=self.output.open("wb"),
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )

    def log(self) -> str:
        return self.output.read_text(errors="replace")

    def processes(self) -> list[int]:
        """Every live process of this run (the run, its workers, engines and beat)."""
        return processes_with_env(f"GENFLEET_STORE={self.store}")

    def wait_running(self, client: redis.Redis, timeout_s: float = 90) -> None:
        """Until one of its batches runs; fails with its output if the run ends first."""

        def running() -> bool:
            if self.proc.poll() is not None:
                raise AssertionError(self.log())
            return bool(client.hlen(keys.running_key()))

        wait_for(running, timeout_s, "a batch of the run to be running", 0.2)

    def wait_gone(self, timeout_s: float = 30) -> None:
        wait_for(lambda: not self.processes(), timeout_s, "every process of the run to end", 0.2)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


StartRun = Callable[[str, Path], BackgroundRun]  # the `start_run` fixture


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


def write_prompt_lines(path: Path, prompts: list[str]) -> Path:
    """A JSONL file of `{"prompt": …}` lines (no ids), its folder made if need be."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(b"".join(orjson.dumps({"prompt": p}) + b"\n" for p in prompts))
    return path


OTHER_MODEL = "other-model"


def stage_other_model_run(
    redis_url: str, store_url: str, directory: Path, run: str = "model-run"
) -> EnqueueResult:
    """A run of 20 prompts in two batches for another model (`OTHER_MODEL`, an external
    engine nobody runs) on the same Redis and store: its orders wait on that model's queue."""
    model = Settings(
        redis_url=SecretStr(redis_url),
        store=store_url,
        batch_size=10,
        engine="external",
        engine_url="http://127.0.0.1:9",
        served_model_name=OTHER_MODEL,
    )
    write_prompts(directory / "m.jsonl", 20, prefix="m")
    return enqueue_run(model, run, str(directory / "m.jsonl"), reader_options(model))


def stage_questions(
    settings: Settings, run: str, directory: Path, count: int, prefix: str = "q"
) -> EnqueueResult:
    """Stage `count` prompt lines, PREFIX0, PREFIX1, …, from DIRECTORY/RUN.jsonl as `run`."""
    source = write_prompt_lines(directory / f"{run}.jsonl", [f"{prefix}{i}" for i in range(count)])
    return stage(settings, run, source)


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
    """Wait for every batch of `run` to have its output; returns how long that took (s).
    At the deadline it fails with where the run stood (its batches by state)."""
    objects = store or open_run_store(settings)
    started = time.monotonic()
    try:
        wait_for(
            lambda: run_status(objects, client, run)["state"] == "done",
            timeout_s,
            f"run {run} to finish",
            0.25,
        )
    except AssertionError as exc:
        status = run_status(objects, client, run)
        stood = {k: v for k, v in status.items() if k == "state" or k.startswith("batches_")}
        raise AssertionError(f"{exc}: {stood}") from None
    return time.monotonic() - started


def wait_run_ended(
    settings: Settings, client: redis.Redis, run: str, timeout_s: float
) -> dict[str, Any]:
    """Wait until `run` is done or failed; returns its status then."""
    objects = open_run_store(settings)

    def ended() -> dict[str, Any] | None:
        status = run_status(objects, client, run)
        return status if status["state"] in {"done", "failed"} else None

    status: dict[str, Any] = wait_for(ended, timeout_s, f"run {run} to end", 0.5)
    return status


def export_rows(
    settings: Settings, run: str, path: Path, **options: Any
) -> tuple[ExportResult, list[dict[str, Any]]]:
    """`export RUN --out PATH` (JSONL, whole runs only; `options` as export_run takes them) and
    the rows it wrote."""
    result = export_run(settings, run, str(path), "jsonl", False, **options)
    return result, [orjson.loads(line) for line in path.read_bytes().splitlines()]


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
        result, rows = export_rows(settings, run, target)
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


def cmdline(pid: int) -> list[bytes]:
    """The argv of process `pid`, [] once it is gone."""
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")[:-1]
    except OSError:
        return []


def live_children(pid: int, needle: bytes) -> list[int]:
    """Live children of `pid` whose command line holds `needle` (an engine: `sglang`, ...)."""
    return [c for c in child_pids(pid) if needle in b" ".join(cmdline(c)) and pid_alive(c)]


def engine_pid(worker: Worker) -> int | None:
    """The pid of the worker's emulator engine, or None while it has none."""
    found = live_children(worker.proc.pid, b"genfleet.workers.engine.emulator")
    return found[0] if found else None


def leases_of(client: redis.Redis, run: str, hostname: str | None = None) -> set[str]:
    """Batches of `run` whose lease `hostname` (or any worker) holds right now."""
    held = set()
    for key in client.scan_iter(match=keys.lease_key(run, "*")):
        if hostname is None or client.get(key) == hostname.encode():
            held.add(key.decode().rsplit(":", 1)[1])
    return held


def running_batches(
    client: redis.Redis,
    store: Store,
    run: str,
    hostname: str | None = None,
    checkpointed: bool = False,
) -> set[str]:
    """Batches of `run` running now: leased (by `hostname`, or by any worker), no output yet
    and, if `checkpointed`, a checkpoint part written (past their store reads)."""
    running = leases_of(client, run, hostname) - outputs(store, run)
    if checkpointed:
        running = {b for b in running if any(True for _ in store.list(keys.parts_prefix(run, b)))}
    return running


def wait_batch_running(
    client: redis.Redis,
    store: Store,
    run: str,
    hostname: str | None = None,
    checkpointed: bool = False,
    interval_s: float = 0.05,
) -> set[str]:
    """Wait (a minute at most) until a batch of `run` runs (`running_batches`); returns them."""
    what = f"a batch of {run} to be running" + (" and checkpointed" if checkpointed else "")
    found: set[str] = wait_for(
        lambda: running_batches(client, store, run, hostname, checkpointed), 60, what, interval_s
    )
    return found


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


# --- one batch in process, on the fakes (tests/fakes): the core tests of the task and batch

PARAMS = GenerationParams(max_tokens=16, temperature=0.0, top_p=1.0, thinking=False)
# a reasoning model's sampling, as the engine client's tests send it
THINKING_PARAMS = GenerationParams(max_tokens=64, temperature=0.6, top_p=0.95, thinking=True)
RUN, BATCH = "r", "batch-000000"
MakeFeeder = Callable[..., Feeder]  # the `feeders` fixture (tests/workers/conftest.py)
MakeRuntime = Callable[..., FakeRuntime]  # the `make_runtime` fixture
# the reaper's clock in the core tests, and the lease it reads
NOW = 1_700_000_000.0
TTL_S = 10.0


def core_order(batch: str = BATCH, prompts: int = 5, run: str = RUN) -> WorkOrder:
    """The work order of `batch` of `run` on the emulator queue, its input at the usual key."""
    return WorkOrder(
        run=run,
        batch=batch,
        key=keys.input_key(run, batch),
        params=PARAMS,
        model="emulator",
        engine="emulator",
        prompts=prompts,
    )


def stage_batch(store: Store, count: int, data: bytes | None = None) -> WorkOrder:
    """BATCH's input object (`count` prompts p0… asking q0…, or `data` as it is) and its order."""
    records = [
        PromptRecord(id=f"p{i}", messages=[{"role": "user", "content": f"q{i}"}])
        for i in range(count)
    ]
    order = core_order(prompts=count)
    store.put(order.key, encode_jsonl_gz(r.to_json() for r in records) if data is None else data)
    return order


def stage_task(runtime: FakeRuntime, count: int, data: bytes | None = None) -> dict[str, Any]:
    """What `generate_batch` is sent for BATCH, staged as enqueue leaves it (input, queued)."""
    order = stage_batch(runtime.store, count, data)
    runtime.redis.sadd(keys.queued_key(RUN), BATCH)
    return order.model_dump(mode="json")


def batch_state(db: MemoryRedis) -> dict[str, Any]:
    """What Redis says about BATCH after the task: running, tries, failed, queued."""
    return {
        "running": db.hget(keys.running_key(), running_field(RUN, BATCH)) is not None,
        "attempts": int(db.hget(keys.attempts_key(RUN), BATCH) or 0),
        "failed": (db.hget(keys.failed_key(RUN), BATCH) or b"").decode().split(":")[0] or None,
        "queued": BATCH.encode() in db.smembers(keys.queued_key(RUN)),
    }


def running_order(db: MemoryRedis, batch: str, claimed_at: float) -> dict[str, Any]:
    """`batch` claimed at `claimed_at` (its running entry, no lease yet); returns its order."""
    order = core_order(batch).model_dump(mode="json")
    db.hset(
        keys.running_key(),
        running_field(RUN, batch),
        orjson.dumps({**order, "claimed_at": claimed_at}),
    )
    return order


def execute_batch(
    order: WorkOrder,
    store: Store,
    db: MemoryRedis,
    feeder: Feeder,
    lease_ttl_s: float = 30,
    checkpoint_interval_s: float = 60,
) -> BatchSummary:
    """`batch.execute` of `order` by worker `w@test`."""
    return execute(
        order,
        store=store,
        client=db,
        feeder=feeder,
        worker="w@test",
        lease_ttl_s=lease_ttl_s,
        checkpoint_interval_s=checkpoint_interval_s,
    )


def output_rows(store: Store) -> list[dict[str, Any]]:
    """BATCH's output records, [] while it has no output object."""
    return list(decode_jsonl_gz(store.get(keys.output_key(RUN, BATCH)) or b""))


# --- the compose file, read as Compose reads it (no Docker engine needed)

COMPOSE = ROOT / "compose.yaml"
_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


def load_compose() -> dict[str, Any]:
    """The compose file as Compose sees it before interpolation (YAML anchors merged)."""
    data: dict[str, Any] = yaml.safe_load(COMPOSE.read_text())
    return data


def interpolate(text: str, env: Mapping[str, str]) -> str:
    """Compose's `${VAR}`, `${VAR:-default}` (nested), `${VAR:?error}`, `$VAR` and `$$`."""
    out: list[str] = []
    i = 0
    while i < len(text):
        if text.startswith("$$", i):
            out.append("$")
            i += 2
        elif text.startswith("${", i):
            depth, end = 0, i + 1
            for end in range(i + 1, len(text)):  # the brace that closes this one
                depth += {"{": 1, "}": -1}.get(text[end], 0)
                if not depth:
                    break
            out.append(_substitute(text[i + 2 : end], env))
            i = end + 1
        elif text[i] == "$" and (match := _NAME.match(text, i + 1)):
            out.append(env.get(match.group(), ""))
            i = match.end()
        else:
            out.append(text[i])
            i += 1
    return "".join(out)


def _substitute(body: str, env: Mapping[str, str]) -> str:
    match = _NAME.match(body)
    assert match, f"bad variable reference ${{{body}}}"
    name, rest = match.group(), body[match.end() :]
    value = env.get(name)
    unset_or_empty = not value
    for op in (":-", ":?", ":+", "-", "?", "+"):
        if rest.startswith(op):
            arg = rest[len(op) :]
            missing = unset_or_empty if op.startswith(":") else value is None
            if op.endswith("-"):
                return interpolate(arg, env) if missing else str(value)
            if op.endswith("?"):
                if missing:
                    raise KeyError(f"{name}: {arg}")
                return str(value)
            return "" if missing else interpolate(arg, env)
    assert not rest, f"unsupported variable reference ${{{body}}}"
    return value or ""


def service_environment(service: Mapping[str, Any], env: Mapping[str, str]) -> dict[str, str]:
    """A service's container environment: a key without a value comes from `env` or is unset."""
    result: dict[str, str] = {}
    for key, value in (service.get("environment") or {}).items():
        if value is None:
            if key in env:
                result[key] = env[key]
            continue
        result[key] = interpolate(str(value), env)
    return result


def argv(service: Mapping[str, Any]) -> list[str]:
    """entrypoint + command, each in list or string form."""
    parts: list[str] = []
    for field in ("entrypoint", "command"):
        value = service.get(field) or []
        parts += shlex.split(value) if isinstance(value, str) else [str(v) for v in value]
    return parts


def seconds(duration: str) -> float:
    units = {"h": 3600, "m": 60, "s": 1, "ms": 0.001}
    parts = re.findall(r"(\d+(?:\.\d+)?)(ms|h|m|s)", duration)
    assert parts and "".join(n + u for n, u in parts) == duration, duration
    return sum(float(n) * units[u] for n, u in parts)


# --- datasets and S3 sources for the readers


def lines(path: Path, rows: list[Any]) -> Path:
    """A JSONL file of `rows` (bytes written as they are, anything else as JSON)."""
    path.write_bytes(
        b"".join((r if isinstance(r, bytes) else orjson.dumps(r)) + b"\n" for r in rows)
    )
    return path


def split(items: Any) -> tuple[list[PromptRecord], list[Reject]]:
    """A reader's output as (prompts, rejects)."""
    records: list[PromptRecord] = []
    rejects: list[Reject] = []
    for item in items:
        (rejects if isinstance(item, Reject) else records).append(item)
    return records, rejects


def save_dataset(directory: Path, tables: list[pa.Table], split: str = "train") -> Path:
    """The layout `Dataset.save_to_disk` writes: Arrow IPC streams + state + info."""
    import pyarrow as pa

    directory.mkdir(parents=True)
    names = [f"data-{i:05d}-of-{len(tables):05d}.arrow" for i in range(len(tables))]
    for name, table in zip(names, tables, strict=True):
        with pa.OSFile(str(directory / name), "wb") as sink:
            with pa.ipc.new_stream(sink, table.schema) as writer:
                for batch in table.to_batches(max_chunksize=2):
                    writer.write_batch(batch)
    state: dict[str, Any] = {
        "_data_files": [{"filename": n} for n in names],
        "_fingerprint": "0123456789abcdef",
        "_format_columns": None,
        "_format_kwargs": {},
        "_format_type": None,
        "_output_all_columns": False,
        "_split": split,
    }
    (directory / "state.json").write_bytes(orjson.dumps(state))
    (directory / "dataset_info.json").write_bytes(orjson.dumps({"features": {}, "splits": {}}))
    return directory


class Bucket:
    """A fresh bucket on the S3 server at `endpoint`, written to with boto3."""

    def __init__(self, endpoint: str) -> None:
        import boto3

        self.endpoint = endpoint
        self.name = new_bucket(endpoint).removeprefix("s3://").split("/")[0]
        self.client = boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1")

    def put(self, key: str, data: bytes) -> str:
        self.client.put_object(Bucket=self.name, Key=key, Body=data)
        return f"s3://{self.name}/{key}"

    def options(self, **kwargs: Any) -> ReaderOptions:
        return ReaderOptions(s3_endpoint_url=self.endpoint, **kwargs)
