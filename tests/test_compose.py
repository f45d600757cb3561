"""compose.yaml checked against the code: commands, settings, GPUs, health, profiles, secrets.

No Docker engine runs here, so these tests read the file the way Compose does (YAML anchors
merged, `${VAR}` interpolated from an environment) and hold every service to what genfleet
actually provides: registered CLI commands, an importable Celery app, real settings.
"""

from __future__ import annotations

import importlib
import os
import re
import shlex
import subprocess
import sys
import tomllib
from collections.abc import Mapping
from typing import Any

import pytest

from harness.env import ROOT
from tests.support.compose_file import (
    COMPOSE,
    argv,
    interpolate,
    load_compose,
    seconds,
    service_environment,
)

ENV_EXAMPLE = ROOT / ".env.example"
DOCKERFILE = ROOT / "Dockerfile"
GENFLEET_VAR = re.compile(r"\bGENFLEET_[A-Z0-9_]+\b")
SECRET_NAME = re.compile(r"PASSWORD|SECRET|TOKEN|ACCESS_KEY|BASIC_AUTH")


def active_services(compose: Mapping[str, Any], profiles: set[str]) -> dict[str, Any]:
    """What `docker compose up` starts with these profiles: no profile, or a matching one."""
    return {
        name: svc
        for name, svc in compose["services"].items()
        if not svc.get("profiles") or profiles & set(svc["profiles"])
    }


def env_example() -> dict[str, str]:
    pairs = {}
    for line in ENV_EXAMPLE.read_text().splitlines():
        if line.strip() and not line.lstrip().startswith("#"):
            key, _, value = line.partition("=")
            pairs[key.strip()] = value.strip()
    return pairs


def ours(service: Mapping[str, Any]) -> bool:
    return str(service.get("image", "")).startswith("genfleet")


def genfleet_commands() -> set[str]:
    import typer

    from genfleet.cli import app

    return set(typer.main.get_command(app).list_commands(None))  # type: ignore[attr-defined]


def devices(service: Mapping[str, Any]) -> list[dict[str, Any]]:
    deploy = service.get("deploy") or {}
    found: list[dict[str, Any]] = (
        deploy.get("resources", {}).get("reservations", {}).get("devices", [])
    )
    return found


def check_celery(args: list[str]) -> None:
    """`celery -A module.path SUBCOMMAND …`: the app imports and the subcommand exists."""
    from celery import Celery
    from celery.bin.celery import celery as celery_cli

    assert args[:1] == ["-A"], args
    module, _, attr = args[1].partition(":")
    app = getattr(importlib.import_module(module), attr or "app")
    assert isinstance(app, Celery), args[1]
    assert args[2] in celery_cli.commands, f"celery has no {args[2]!r} command"
    if args[2] == "flower":
        from flower.options import options

        for option in args[3:]:
            name = option.removeprefix("--").partition("=")[0].replace("-", "_")
            assert name in options._options, f"flower has no option {option}"


def check_argv(parts: list[str]) -> None:
    from genfleet.workers.cli import parse

    program, args = parts[0], parts[1:]
    if program == "genfleet":
        words = [a for a in args if not a.startswith("-")]
        if words:
            assert words[0] in genfleet_commands(), f"genfleet has no {words[0]!r} command"
            if words[0] in {"worker", "control", "flower"}:
                parse(words[0], args[args.index(words[0]) + 1 :])
        else:
            assert args == ["--help"], args
    elif program == "celery":
        check_celery(args)
    elif program in {"python3", "python"}:
        assert args[0] == "-c", args
        compile(args[1], "<compose>", "exec")
    else:
        raise AssertionError(f"{program!r} is neither genfleet, celery nor python")


def test_compose_file_follows_the_compose_specification() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "check_jsonschema", "--builtin-schema", "vendor.compose-spec"]
        + [str(COMPOSE)],
        capture_output=True,
        text=True,
        check=False,
    )
    assert result.returncode == 0, result.stdout + result.stderr


def test_every_command_names_a_real_cli_or_celery_app() -> None:
    services = {n: s for n, s in load_compose()["services"].items() if ours(s)}
    assert {"bucket-init", "worker", "worker-dry", "beat", "flower", "producer"} <= set(services)
    for name, service in services.items():
        parts = argv(service)
        assert parts, f"{name} has no command"
        check_argv(parts)
        health = (service.get("healthcheck") or {}).get("test")
        if health:
            if health[0] == "CMD-SHELL":
                check_argv(shlex.split(interpolate(health[1], {"HOSTNAME": "host"})))
            else:
                assert health[0] == "CMD", health
                check_argv(health[1:])


def test_every_genfleet_variable_is_a_setting() -> None:
    from genfleet.common.settings import setting_names

    for path in (COMPOSE, ENV_EXAMPLE):
        unknown = set(GENFLEET_VAR.findall(path.read_text())) - setting_names()
        assert not unknown, f"{path.name} names variables genfleet ignores: {sorted(unknown)}"


def test_gpu_reservations_are_well_formed() -> None:
    services = load_compose()["services"]
    assert devices(services["worker"]), "the GPU worker reserves no GPU"
    for name, service in services.items():
        for device in devices(service):
            assert device.get("driver") == "nvidia", name
            assert "gpu" in device.get("capabilities", []), name
            assert ("count" in device) != ("device_ids" in device), f"{name}: count XOR device_ids"


def test_every_long_running_service_has_a_healthcheck() -> None:
    for name, service in load_compose()["services"].items():
        one_shot = service.get("restart") == "no" or service.get("profiles") == ["tools"]
        if not one_shot:
            assert (service.get("healthcheck") or {}).get("test"), f"{name} has no healthcheck"


def test_redis_has_a_password_append_only_file_and_no_eviction() -> None:
    redis = load_compose()["services"]["redis"]
    command = " ".join(argv(redis))
    assert '--requirepass "$$REDIS_PASSWORD"' in command
    assert "--appendonly yes" in command
    assert "--maxmemory-policy noeviction" in command
    assert redis["environment"]["REDIS_PASSWORD"].startswith("${REDIS_PASSWORD")
    assert "REDIS_PASSWORD" in " ".join(redis["healthcheck"]["test"])
    assert any(v.endswith(":/data") for v in redis["volumes"])


def test_dry_run_profile_runs_the_whole_stack_without_a_gpu() -> None:
    active = active_services(load_compose(), {"dry-run"})
    assert {"redis", "s3", "bucket-init", "beat", "flower", "worker-dry"} <= set(active)
    assert "worker" not in active
    for name, service in active.items():
        assert not devices(service), f"{name} reserves a device under --profile dry-run"
    dry = active["worker-dry"]
    assert argv(dry) == ["genfleet", "worker"]
    assert dry["environment"]["GENFLEET_ENGINE"] == "emulator"


def test_default_profiles_run_the_gpu_worker() -> None:
    profiles = set(env_example()["COMPOSE_PROFILES"].split(","))
    active = active_services(load_compose(), profiles)
    assert "worker" in active and "worker-dry" not in active and "producer" not in active
    worker = active["worker"]
    assert argv(worker) == ["genfleet", "worker"]
    assert worker["environment"]["GENFLEET_ENGINE"] == "sglang"
    assert {"GENFLEET_GPUS", "GENFLEET_TP_SIZE", "GENFLEET_MODEL"} <= set(worker["environment"])


def test_exactly_one_beat_in_every_profile() -> None:
    compose = load_compose()
    for profiles in ({"gpu"}, {"dry-run"}, {"gpu", "tools"}):
        beats = [
            name
            for name, svc in active_services(compose, profiles).items()
            if argv(svc)[:2] == ["genfleet", "control"]
            or "--beat" in argv(svc)
            or argv(svc)[2:4] == ["genfleet.workers.app", "beat"]
        ]
        assert beats == ["beat"], (profiles, beats)
    assert compose["services"]["beat"].get("deploy", {}).get("replicas", 1) == 1


def test_flower_asks_for_basic_auth_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    from flower.command import apply_env_options
    from flower.options import options

    flower = load_compose()["services"]["flower"]
    assert argv(flower)[:2] == ["genfleet", "flower"]
    assert flower["environment"]["FLOWER_BASIC_AUTH"].startswith("${FLOWER_BASIC_AUTH:?")
    assert any(v.endswith(":/data") for v in flower["volumes"])
    assert "--db=/data/flower.db" in argv(flower) and "--port=5555" in argv(flower)
    # `genfleet flower` runs Flower persistent, with genfleet's columns and result lines
    from genfleet.workers.observe import flower as launcher

    assert "--persistent=True" in launcher.flower_argv(5555, "0.0.0.0", "/data/flower.db")
    assert "result" in launcher.tasks_columns.split(",")
    assert any(str(p).endswith(":5555") for p in flower["ports"])
    # Flower itself turns FLOWER_BASIC_AUTH into its --basic-auth option.
    before = options.basic_auth
    monkeypatch.setattr(os, "environ", {"FLOWER_BASIC_AUTH": "ops:pw"})
    try:
        apply_env_options()
        assert options.basic_auth == ["ops:pw"]
    finally:
        options.basic_auth = before


def test_no_secret_is_written_in_the_compose_file() -> None:
    text = COMPOSE.read_text()
    for service in load_compose()["services"].values():
        for key, value in (service.get("environment") or {}).items():
            if SECRET_NAME.search(key) and value is not None:
                assert re.fullmatch(r"\$\{[^}]+\}", str(value)), f"{key} is not a ${{VAR}}"
    for password in re.findall(r"://[^/\s:@]*:([^@\s/]+)@", text):
        assert password.startswith("${"), f"a literal password in a URL: {password}"
    example = env_example()
    for key, value in example.items():
        if SECRET_NAME.search(key):
            assert "change-me" in value, f".env.example must hold a placeholder for {key}"
            assert value not in text
    assert ".env" in (ROOT / ".gitignore").read_text().split()
    assert ".env" in (ROOT / ".dockerignore").read_text().split()


def test_workers_outlast_the_soft_shutdown_window() -> None:
    from genfleet.common.celery_config import celery_config
    from genfleet.common.settings import Settings

    settings = Settings()
    # running batches get shutdown_grace_s, then 15 s to checkpoint and hand back; then the
    # engine stops (stop_timeout_s); Celery's own soft-shutdown window bounds the rest
    needed_s = (
        max(
            celery_config(settings)["worker_soft_shutdown_timeout"],
            settings.shutdown_grace_s + 15,
        )
        + settings.stop_timeout_s
    )
    services = load_compose()["services"]
    for name in ("worker", "worker-dry"):
        assert seconds(services[name]["stop_grace_period"]) > needed_s, name
        # SIGTERM is the warm stop: running batches get their grace, then are checkpointed
        # and handed back, and the engine stops last (tests/faults/test_fault_shutdown.py).
        assert services[name].get("stop_signal", "SIGTERM") == "SIGTERM", name
        assert "REMAP_SIGTERM" not in services[name]["environment"], name


def test_every_genfleet_process_shares_broker_and_visibility_timeout() -> None:
    services = [s for s in load_compose()["services"].values() if ours(s)]
    for key in ("GENFLEET_REDIS_URL", "GENFLEET_VISIBILITY_TIMEOUT_S", "GENFLEET_STORE"):
        values = {s["environment"][key] for s in services}
        assert len(values) == 1, (key, values)


def test_startup_order_waits_for_health_and_the_bucket() -> None:
    services = load_compose()["services"]
    for name, service in services.items():
        for dependency, spec in (service.get("depends_on") or {}).items():
            assert spec["condition"] in {
                "service_healthy",
                "service_completed_successfully",
            }, (name, dependency)
            wanted = "service_completed_successfully" if dependency == "bucket-init" else None
            assert spec["condition"] == (wanted or "service_healthy"), (name, dependency)
    assert services["bucket-init"]["depends_on"] == {"s3": {"condition": "service_healthy"}}
    for name in ("worker", "worker-dry", "beat", "producer"):
        assert {"redis", "bucket-init"} <= set(services[name]["depends_on"]), name
    assert "redis" in services["flower"]["depends_on"]


def test_gpu_worker_gets_models_cache_shared_memory_and_ulimits() -> None:
    worker = load_compose()["services"]["worker"]
    targets = {interpolate(v, {"HOME": "/home/u"}).split(":")[1] for v in worker["volumes"]}
    assert {"/models", "/root/.cache/huggingface"} <= targets
    assert worker.get("ipc") == "host" or worker.get("shm_size")
    assert worker["ulimits"] == {"memlock": -1, "stack": 67108864}
    assert worker["build"]["target"] == "worker"


def test_the_producer_sends_orders_to_the_queue_its_workers_consume() -> None:
    from genfleet.common.routing import model_ref, work_queue, worker_queue
    from genfleet.common.settings import Settings

    services = load_compose()["services"]

    def settings(service: str, dotenv: dict[str, str], **flags: str) -> Settings:
        secrets = {"REDIS_PASSWORD": "pw", "S3_ACCESS_KEY_ID": "k", "S3_SECRET_ACCESS_KEY": "s"}
        env = service_environment(services[service], {**secrets, **dotenv})
        values = {k.removeprefix("GENFLEET_").lower(): v for k, v in env.items()}
        values = {k: v for k, v in values.items() if k in Settings.model_fields}
        return Settings.from_overrides({**values, **flags})

    def target(producer: Settings) -> str:
        return work_queue(producer.queue, model_ref(producer))

    gpu = {"GENFLEET_MODEL": "/models/Qwen3.6-27B"}
    assert target(settings("producer", gpu)) == worker_queue(settings("worker", gpu))
    assert worker_queue(settings("worker", gpu)) != worker_queue(settings("worker-dry", gpu))
    # the dry run: the emulator's queue, with the model unset or --engine emulator
    dry = worker_queue(settings("worker-dry", gpu))
    assert target(settings("producer", {})) == dry
    assert target(settings("producer", gpu, engine="emulator")) == dry

    # and the model the producer records for a run is the one those workers serve, a
    # --quantization among the engine's extra args included (common/model_identity.py)
    from genfleet.common.model_identity import asked, judge
    from genfleet.workers.engine.families import choose
    from genfleet.workers.engine.fingerprint import checkpoint_identity

    def serves(worker: Settings, producer: Settings) -> bool:
        return judge(asked(producer), checkpoint_identity(worker, choose(worker, None))).serves

    fp8 = {**gpu, "GENFLEET_ENGINE_EXTRA_ARGS": "--quantization fp8"}
    assert serves(settings("worker", fp8), settings("producer", fp8))
    assert serves(settings("worker-dry", fp8), settings("producer", fp8, engine="emulator"))


def test_producer_is_a_tool_run_on_demand() -> None:
    producer = load_compose()["services"]["producer"]
    assert producer["profiles"] == ["tools"]
    assert producer["entrypoint"] == ["genfleet"]
    assert {"enqueue", "status", "export"} <= genfleet_commands()


def test_dockerfile_builds_the_targets_compose_asks_for() -> None:
    text = DOCKERFILE.read_text()
    stages = {target: image for image, target in re.findall(r"^FROM (\S+) AS (\S+)$", text, re.M)}
    assert stages["worker"] == "lmsysorg/sglang:${SGLANG_IMAGE_TAG}"
    assert stages["slim"] == "${PYTHON_IMAGE}"
    assert "ARG PYTHON_IMAGE=python:3.11-slim" in text
    tag = re.search(r"^ARG SGLANG_IMAGE_TAG=(\S+)$", text, re.M)
    assert tag and tag.group(1) == "v0.5.19-cu129"
    compose = load_compose()["services"]
    assert compose["worker"]["build"]["args"]["SGLANG_IMAGE_TAG"].endswith(f":-{tag.group(1)}}}")
    for name, service in compose.items():
        if "build" in service:
            assert service["build"]["target"] in stages, name
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    extras = set(project["optional-dependencies"])
    for group in re.findall(r'pip install "\.\[([a-z,]+)\]"', text):
        assert set(group.split(",")) <= extras, group
    assert re.search(r"^USER (?!root)\S+$", text, re.M), "the slim image runs as root"


def test_readme_test_command_validates_the_compose_file() -> None:
    lines = (ROOT / "README.md").read_text().splitlines()
    command = lines[lines.index("<!-- test-command -->") + 2]
    assert command.startswith(
        "check-jsonschema --builtin-schema vendor.compose-spec compose.yaml && "
    )


def test_no_healthcheck_needs_a_newer_engine_than_readme_states() -> None:
    # Engine < 25 refuses healthcheck.start_interval, and compose then creates no container.
    for name, service in load_compose()["services"].items():
        assert "start_interval" not in (service.get("healthcheck") or {}), name
    assert "start_interval" not in COMPOSE.read_text().replace("No start_interval", "")
    readme = (ROOT / "README.md").read_text()
    assert "Docker Engine 20.10" in readme and "Compose v2" in readme
    assert "docker-compose` 1." in readme  # and it warns off Compose v1


def test_dockerfile_builds_offline_and_slim_without_the_sglang_image() -> None:
    text = DOCKERFILE.read_text()
    # A syntax line makes BuildKit fetch a frontend image: offline builds fail.
    assert not re.search(r"^#\s*syntax\s*=", text, re.M | re.I)
    # The classic builder builds every stage up to the target: slim must not follow worker.
    targets = re.findall(r"^FROM \S+ AS (\S+)$", text, re.M)
    assert targets.index("slim") < targets.index("worker")
    after = text[text.index(" AS slim") :]
    slim = after[: after.index("\nFROM ")]
    assert "lmsysorg" not in slim and "--from" not in slim


def test_published_ports_are_settings_with_todays_defaults() -> None:
    services = load_compose()["services"]
    example = env_example()
    expected = {"redis": ("REDIS", 6379), "s3": ("S3", 8333), "flower": ("FLOWER", 5555)}
    published = {name: svc["ports"] for name, svc in services.items() if svc.get("ports")}
    assert set(published) == set(expected)
    for name, (prefix, port) in expected.items():
        assert published[name] == [
            f"${{{prefix}_BIND:-127.0.0.1}}:${{{prefix}_PORT:-{port}}}:{port}"
        ], name
        assert example[f"{prefix}_PORT"] == str(port)
        moved = interpolate(published[name][0], {f"{prefix}_PORT": "16379"})
        assert moved == f"127.0.0.1:16379:{port}"
