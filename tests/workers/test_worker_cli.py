"""`genfleet worker` as an operator runs it: GPU groups, an external engine, dry printing."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import orjson
import pytest
import redis

from genfleet.common.settings import Settings
from genfleet.common.store import open_store
from genfleet.producer.enqueue import enqueue_run, reader_options
from genfleet.producer.export import export_run
from genfleet.producer.status import run_status
from genfleet.workers.engine.ports import port_is_free
from harness.control import answering
from harness.env import ROOT, base_env, free_port
from harness.processes import Worker
from harness.waits import wait_for
from tests.support.commands import genfleet

pytestmark = [pytest.mark.integration, pytest.mark.slow]


def write_source(path: Path, count: int) -> Path:
    path.write_bytes(b"".join(orjson.dumps({"prompt": f"p{i}"}) + b"\n" for i in range(count)))
    return path


def finish(tmp_path: Path, redis_client: redis.Redis, settings: Settings, run: str) -> list[dict]:
    store = open_store(settings.store)
    wait_for(
        lambda: run_status(store, redis_client, run)["state"] == "done", 120, f"run {run}", 0.3
    )
    out = tmp_path / f"{run}.jsonl"
    export_run(settings, run, str(out), "jsonl", False)
    return [orjson.loads(line) for line in out.read_bytes().splitlines()]


def test_one_worker_and_engine_per_gpu_group(
    tmp_path: Path, redis_url: str, redis_client: redis.Redis
) -> None:
    store = (tmp_path / "store").as_uri()
    port = free_port()
    env = base_env(redis_url, store, gpus="0,1,2,3", tp_size=2, port=port)
    log = tmp_path / "workers.log"
    proc = subprocess.Popen(
        ["genfleet", "worker", "--hostname", "grp@test"],
        env=env,
        cwd=ROOT,
        stdout=log.open("ab"),
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    try:
        group = ["grp0@test", "grp1@test"]
        wait_for(
            lambda: answering(redis_url, group) == set(group), 60, "two group workers to be ready"
        )
        settings = Settings(redis_url=redis_url, store=store, batch_size=10)
        enqueue_run(
            settings,
            "groups",
            str(write_source(tmp_path / "g.jsonl", 200)),
            reader_options(settings),
        )
        rows = finish(tmp_path, redis_client, settings, "groups")
        assert len(rows) == 200
        engines = {(r["engine"]["worker"], r["engine"]["gpus"], r["engine"]["url"]) for r in rows}
        assert {e[:2] for e in engines} == {("grp0@test", "0,1"), ("grp1@test", "2,3")}
        urls = {e[2] for e in engines}
        assert urls == {f"http://127.0.0.1:{port}", f"http://127.0.0.1:{port + 10}"}
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=60)
    # both engines were stopped with their workers: nothing listens on their ports
    assert port_is_free("127.0.0.1", port) and port_is_free("127.0.0.1", port + 10)


def test_external_engine_is_health_checked_not_supervised(
    tmp_path: Path,
    redis_url: str,
    redis_client: redis.Redis,
    start_worker: Callable[..., Worker],
) -> None:
    port = free_port()
    store = (tmp_path / "store").as_uri()
    env = base_env(redis_url, store)
    engine = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "genfleet.workers.engine.emulator",
            "--model-path",
            "shared/model",
            "--port",
            str(port),
            "--reasoning-parser",
            "qwen3",
        ],
        env=env,
        cwd=ROOT,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        worker = start_worker(
            base_env(redis_url, store, engine="external", engine_url=f"http://127.0.0.1:{port}")
        )
        settings = Settings(
            redis_url=redis_url,
            store=store,
            batch_size=25,
            engine="external",
            engine_url=f"http://127.0.0.1:{port}",
        )
        enqueue_run(
            settings, "ext", str(write_source(tmp_path / "e.jsonl", 50)), reader_options(settings)
        )
        worker.wait_ready()
        rows = finish(tmp_path, redis_client, settings, "ext")
        assert len(rows) == 50
        assert {r["engine"]["kind"] for r in rows} == {"external"}
        assert {r["engine"]["url"] for r in rows} == {f"http://127.0.0.1:{port}"}
        worker.stop()
        assert engine.poll() is None  # not ours to stop
    finally:
        engine.terminate()
        engine.wait(timeout=20)


def test_print_engine_command_launches_nothing(tmp_path: Path) -> None:
    port = free_port()
    result = subprocess.run(
        [
            "genfleet",
            "worker",
            "--print-engine-command",
            "--model",
            str(tmp_path),
            "--port",
            str(port),
            "--engine-api-key",
            "sk-do-not-print",
        ],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
        cwd=ROOT,
    )
    line = result.stdout.strip()
    assert "--speculative-algorithm EAGLE --speculative-num-steps 3" in line
    assert "--speculative-eagle-topk 1 --speculative-num-draft-tokens 4" in line
    assert "--max-running-requests" in line and "--host 127.0.0.1" in line
    assert "sk-do-not-print" not in line
    assert port_is_free("127.0.0.1", port)
    no_mtp = genfleet(
        ["worker", "--print-engine-command", "--model", str(tmp_path), "--no-mtp"], timeout_s=60
    )
    assert no_mtp.returncode == 0, no_mtp.stderr
    assert "--speculative" not in no_mtp.stdout


def test_preflight_command_exit_codes(tmp_path: Path) -> None:
    model = tmp_path / "qwen"
    model.mkdir()
    (model / "config.json").write_text(
        '{"architectures": ["Qwen3_5ForConditionalGeneration"], "num_hidden_layers": 2}'
    )
    (model / "model.safetensors.index.json").write_text(
        '{"weight_map": {"model.layers.0.mlp.weight": "a.safetensors"}}'
    )
    missing = genfleet(["preflight", "--model", str(model)], timeout_s=60)
    assert missing.returncode == 1
    assert "--no-mtp" in missing.stderr and str(model) in missing.stderr
    ok = genfleet(["preflight", "--model", str(model), "--no-mtp"], timeout_s=60)
    assert ok.returncode == 0, ok.stderr


def test_worker_refused_by_preflight_exits_non_zero_with_the_reason(
    tmp_path: Path, redis_url: str
) -> None:
    """A checkpoint without MTP tensors: no engine starts, and the worker must not exit 0
    (a process manager would take that for a clean stop and never say why)."""
    model = tmp_path / "qwen"
    model.mkdir()
    (model / "config.json").write_text(
        '{"architectures": ["Qwen3_5ForConditionalGeneration"], "num_hidden_layers": 2}'
    )
    (model / "model.safetensors.index.json").write_text(
        '{"weight_map": {"model.layers.0.mlp.weight": "a.safetensors"}}'
    )
    env = base_env(redis_url, f"file://{tmp_path / 'store'}", log_dir=tmp_path / "logs")
    worker = genfleet(["worker", "--engine", "sglang", "--model", str(model)], env, timeout_s=60)
    assert worker.returncode == 1
    assert "PreflightError" in worker.stderr and str(model) in worker.stderr
    assert not list((tmp_path / "logs").glob("engine-*.log"))  # no engine was started


def test_worker_without_redis_exits_non_zero_with_the_reason(tmp_path: Path) -> None:
    dead = f"redis://127.0.0.1:{free_port()}/0"
    env = base_env(dead, f"file://{tmp_path / 'store'}")
    worker = genfleet(["worker"], env, timeout_s=60)
    assert worker.returncode == 1
    assert "error:" in worker.stderr and dead in worker.stderr  # names the Redis it tried
    assert "Traceback" not in worker.stderr


def test_control_beat_runs_with_a_log_dir_not_made_yet(
    tmp_path: Path, redis_url: str, start_worker: Callable[..., Worker]
) -> None:
    logs = tmp_path / "not-yet" / "logs"
    env = {
        **base_env(redis_url, f"file://{tmp_path / 'store'}", log_dir=logs),
        "TMPDIR": str(tmp_path),
    }
    control = start_worker(env, role="control")
    # beat's schedule is kept in the user's private directory, whatever --log-dir says
    beat = tmp_path / f"genfleet-{os.getuid()}" / "beat"
    wait_for(lambda: beat.is_dir() and any(beat.iterdir()), 60, "beat's schedule file", 0.2)
    assert control.proc.poll() is None


def test_flags_reach_the_engine_step_and_tasks_without_the_environment(
    tmp_path: Path, redis_url: str, redis_client: redis.Redis
) -> None:
    """Settings given only as flags are handed to the Celery app: the worker consumes the
    flagged queue and writes to the flagged store, while its environment names others."""
    decoy = (tmp_path / "decoy").as_uri()
    store = (tmp_path / "store").as_uri()
    env = base_env(redis_url, decoy, queue="not-this-queue")
    args = ["worker", "--store", store, "--queue", "flagged"]
    worker = Worker(env, tmp_path / "flagged.log", "flagged@test", args)
    try:
        settings = Settings(redis_url=redis_url, store=store, queue="flagged", batch_size=10)
        enqueue_run(
            settings, "flags", str(write_source(tmp_path / "f.jsonl", 30)), reader_options(settings)
        )
        worker.wait_ready()
        rows = finish(tmp_path, redis_client, settings, "flags")
        assert len(rows) == 30 and {r["engine"]["worker"] for r in rows} == {"flagged@test"}
        assert not (tmp_path / "decoy").exists()
    finally:
        worker.stop()


HANDOFF = """
import os
from genfleet.common.errors import ConfigError
from genfleet.common.settings import Settings
from genfleet.workers.app import app, configure, settings_of

given = Settings(queue="handed", redis_url="redis://:pw@h:1/2", power_watch_interval_s=7)
configure(given)
assert settings_of(app) is given
assert app.conf.task_default_queue == "handed" and app.conf.broker_url == "redis://:pw@h:1/2"
assert app.conf.beat_schedule["power-watch"]["schedule"] == 7
assert os.environ["GENFLEET_QUEUE"] == "from-env"  # its own environment is untouched
try:
    configure(Settings())
except ConfigError:
    print("refused")
"""

FROM_ENVIRONMENT = """
from genfleet.workers.app import app, settings_of
assert settings_of(app).queue == "from-env" and app.conf.task_default_queue == "from-env"
print("env")
"""


def test_settings_are_handed_to_the_celery_app_once(tmp_path: Path) -> None:
    """`configure` makes the Celery configuration and `settings_of`; too late is refused. A
    process started by the `celery` program builds them from its environment instead."""
    env = {"PYTHONPATH": str(ROOT), "PATH": os.environ["PATH"], "GENFLEET_QUEUE": "from-env"}
    handed = subprocess.run(
        [sys.executable, "-c", HANDOFF], env=env, capture_output=True, text=True, timeout=60
    )
    assert handed.returncode == 0 and handed.stdout.strip() == "refused", handed.stderr
    from_env = subprocess.run(
        [sys.executable, "-c", FROM_ENVIRONMENT], env=env, capture_output=True, text=True
    )
    assert from_env.returncode == 0 and from_env.stdout.strip() == "env", from_env.stderr


def test_a_worker_listens_to_no_other_workers_events(
    tmp_path: Path, redis_url: str, redis_client: redis.Redis, start_worker: Callable[..., Worker]
) -> None:
    """Gossip is off: a worker's only Pub/Sub subscription is its remote-control mailbox, so
    it does not consume every other worker's heartbeats and task events (Flower still gets
    them: the worker sends them, tests/workers/test_flower.py)."""
    worker = start_worker(base_env(redis_url, (tmp_path / "store").as_uri(), port=free_port()))
    worker.wait_ready()
    db = str(redis_client.connection_pool.connection_kwargs.get("db", 0))
    subscribers = [
        c for c in redis_client.client_list() if c["db"] == db and int(c.get("psub", 0)) > 0
    ]
    assert len(subscribers) == 1, subscribers


def test_engines_get_a_key_and_logs_and_schedules_stay_private_by_default(
    tmp_path: Path, redis_url: str, redis_client: redis.Redis, start_worker: Callable[..., Worker]
) -> None:
    """With no --engine-api-key and no --log-dir: the engine has a key of its own (not on its
    argv) that the worker uses; its log and beat's schedule (a pickle) live in this user's
    0700 directory, not in a shared /tmp path."""
    import stat

    import httpx

    from harness.processes import engine_pid

    store = (tmp_path / "store").as_uri()
    port = free_port()
    env = {**base_env(redis_url, store, port=port), "TMPDIR": str(tmp_path)}
    worker = start_worker(env)
    control = start_worker(env, role="control")
    worker.wait_ready()
    control.wait_ready()
    private = tmp_path / f"genfleet-{os.getuid()}"

    config = orjson.loads((private / "engines" / f"engine-{port}.yaml").read_bytes())
    key = config["api-key"]
    assert len(key) >= 32
    pid = engine_pid(worker)
    assert pid is not None and key.encode() not in Path(f"/proc/{pid}/cmdline").read_bytes()
    base = f"http://127.0.0.1:{port}"
    assert httpx.get(f"{base}/server_info").status_code == 401
    assert httpx.get(f"{base}/server_info", headers={"Authorization": f"Bearer {key}"}).is_success

    settings = Settings(redis_url=redis_url, store=store, batch_size=10)
    source = write_source(tmp_path / "k.jsonl", 20)
    enqueue_run(settings, "keyed", str(source), reader_options(settings))
    assert len(finish(tmp_path, redis_client, settings, "keyed")) == 20

    for folder in (private / "logs", private / "beat"):
        assert stat.S_IMODE(os.lstat(folder).st_mode) == 0o700, folder
    logs = list((private / "logs").iterdir())
    assert logs and all(stat.S_IMODE(os.lstat(p).st_mode) == 0o600 for p in logs)
    assert all(key not in p.read_text(errors="replace") for p in logs)
    assert list((private / "beat").iterdir()), "no beat schedule in the private directory"
    assert not list(tmp_path.glob("genfleet-beat-schedule*"))
    assert not (tmp_path / "genfleet-logs").exists()
