"""`python -m genfleet.workers …`: the GPU side of `genfleet` (worker, control, preflight).

`genfleet worker|control|preflight|tune` hand over to this module, so the producer never
imports the worker stack. Every setting is a flag of the same name (`--max-inflight 8`).
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import NoReturn

import orjson

from genfleet.common.errors import GenfleetError
from genfleet.common.settings import Settings, parse_setting_args

USAGE = """usage: genfleet worker [--gpus 0,1,2,3] [--tp-size N] [--model PATH] [--no-mtp]
                       [--print-engine-command] [--hostname NAME@HOST] [any setting ...]
       genfleet control [any setting ...]
       genfleet preflight --model PATH [--no-mtp] [--json]
       genfleet top [--once] [--json]
       genfleet tune --model PATH [--engine ...] [--concurrency 1,4,16] [--mtp on,off]

Every setting is a flag (`genfleet settings` lists them with their GENFLEET_ variables)."""


def die(message: str, code: int = 2) -> NoReturn:
    print(f"error: {message}", file=sys.stderr)
    sys.exit(code)


def take_flag(args: list[str], flag: str) -> bool:
    if flag in args:
        args.remove(flag)
        return True
    return False


def take_value(args: list[str], flag: str) -> str | None:
    for i, arg in enumerate(args):
        if arg == flag and i + 1 < len(args):
            value = args[i + 1]
            del args[i : i + 2]
            return value
        if arg.startswith(flag + "="):
            del args[i]
            return arg.split("=", 1)[1]
    return None


def settings_from(args: list[str]) -> Settings:
    try:
        return Settings.from_overrides(parse_setting_args(args))
    except ValueError as exc:
        die(str(exc).replace("\n", " "))


def gpu_groups(gpus: str | None, tp_size: int) -> list[str | None]:
    """`0,1,2,3` with tp 2 → ["0,1", "2,3"]; no --gpus → one group that sees what it sees."""
    if not gpus:
        return [None]
    ids = [g.strip() for g in gpus.split(",") if g.strip()]
    if len(ids) % tp_size:
        die(f"--gpus has {len(ids)} GPUs, not a multiple of --tp-size {tp_size}")
    return [",".join(ids[i : i + tp_size]) for i in range(0, len(ids), tp_size)]


def group_settings(settings: Settings, group: str | None, index: int, count: int) -> Settings:
    """Settings of the index-th worker: its GPUs and its own engine port."""
    port = settings.port + index * 10 if count > 1 else settings.port
    return settings.model_copy(update={"gpus": group, "port": port})


def worker(args: list[str]) -> None:
    print_only = take_flag(args, "--print-engine-command")
    index_text = take_value(args, "--worker-index")
    hostname = take_value(args, "--hostname")
    settings = settings_from(args)
    groups = gpu_groups(settings.gpus, settings.tp_size)
    if print_only:
        from genfleet.workers.engine.kinds import print_engine_command

        for i, group in enumerate(groups):
            each = group_settings(settings, group, i, len(groups))
            prefix = f"CUDA_VISIBLE_DEVICES={group} " if group else ""
            print(prefix + print_engine_command(each, each.port))
        return
    if len(groups) > 1 and index_text is None:
        run_group_workers(settings, groups, hostname)
        return
    index = int(index_text) if index_text is not None else None
    run_celery_worker(settings, index, hostname)


def run_group_workers(settings: Settings, groups: list[str | None], hostname: str | None) -> None:
    """One child worker per GPU group; signals are forwarded; exit when they all exit."""
    procs: list[subprocess.Popen[bytes]] = []
    for i, group in enumerate(groups):
        each = group_settings(settings, group, i, len(groups))
        env = {**os.environ, **each.child_env()}
        argv = [sys.executable, "-m", "genfleet.workers", "worker", "--worker-index", str(i)]
        if hostname:  # name@host → name0@host, name1@host, ...
            name, _, domain = hostname.partition("@")
            argv += ["--hostname", f"{name}{i}@{domain or socket.gethostname()}"]
        procs.append(subprocess.Popen(argv, env=env))

    def forward(signum: int, _frame: object) -> None:
        for proc in procs:
            if proc.poll() is None:
                proc.send_signal(signum)

    signal.signal(signal.SIGTERM, forward)
    signal.signal(signal.SIGINT, forward)
    codes = [proc.wait() for proc in procs]
    sys.exit(max(codes))


def run_celery_worker(settings: Settings, index: int | None, hostname: str | None) -> None:
    os.environ.update(settings.child_env())
    host = socket.gethostname()
    name = hostname or (f"gpu{index}@{host}" if index is not None else f"gpu@{host}")
    from genfleet.workers.app import app

    app.worker_main(
        [
            "worker",
            "--queues",
            settings.queue,
            "--concurrency",
            str(settings.worker_concurrency),
            "--hostname",
            name,
            "--loglevel",
            "INFO",
            "--task-events",
            "--without-mingle",
        ]
    )


def control(args: list[str]) -> None:
    """The control worker: runs beat (exactly one per fleet) and its tasks; no engine."""
    hostname = take_value(args, "--hostname")
    settings = settings_from(args).model_copy(update={"role": "control"})
    os.environ.update(settings.child_env())
    schedule = Path(settings.log_dir or tempfile.gettempdir()) / "genfleet-beat-schedule"
    from genfleet.workers.app import app

    app.worker_main(
        [
            "worker",
            "--beat",
            "--schedule",
            str(schedule),
            "--queues",
            "control",
            "--concurrency",
            "2",
            "--hostname",
            hostname or f"control@{socket.gethostname()}",
            "--loglevel",
            "INFO",
            "--task-events",
            "--without-mingle",
        ]
    )


def preflight(args: list[str]) -> None:
    json_out = take_flag(args, "--json")
    settings = settings_from(args)
    if not settings.model:
        die("preflight needs --model PATH")
    from genfleet.workers.engine.preflight import preflight as check

    try:
        report = check(settings)
    except GenfleetError as exc:
        if json_out:
            print(orjson.dumps({"ok": False, "error": str(exc)}).decode())
        die(str(exc), 1)
    if json_out:
        print(orjson.dumps({"ok": True, **report.to_json()}).decode())
        return
    print(f"ok: {settings.model} would start ({report.arch}; MTP {report.mtp_layout or 'off'})")
    for warning in report.warnings:
        print(f"warning: {warning}")


def top(args: list[str]) -> None:
    once = take_flag(args, "--once")
    json_out = take_flag(args, "--json")
    settings = settings_from(args)
    from genfleet.workers.observe.top import main as top_main

    try:
        top_main(settings, once, json_out)
    except KeyboardInterrupt:
        pass


def main(argv: list[str]) -> None:
    if not argv or argv[0] in {"-h", "--help", "help"}:
        print(USAGE)
        return
    command, args = argv[0], list(argv[1:])
    if "--help" in args or "-h" in args:
        print(USAGE)
        return
    commands = {"worker": worker, "control": control, "preflight": preflight, "top": top}
    if command == "tune":
        from genfleet.workers.tune.command import main as tune_main

        tune_main(args)
        return
    if command not in commands:
        die(f"unknown command {command!r}\n{USAGE}")
    try:
        commands[command](args)
    except GenfleetError as exc:
        die(str(exc))


if __name__ == "__main__":
    main(sys.argv[1:])
