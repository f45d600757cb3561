"""`docker compose --profile dry-run up` for real: a run in and out, Flower, a worker restart.

Everything goes through Docker and the project's own compose.yaml and Dockerfile: the
producer service enqueues, follows `status --json` and exports; outputs are also read
straight from the stack's S3 server (SeaweedFS) to check that nothing was written twice.
"""

from __future__ import annotations

import base64
import gzip
import json
import os
import shutil
import stat
import subprocess
import time
import urllib.error
import urllib.request
from collections import Counter
from pathlib import Path
from typing import Any

import pytest

from harness.waits import wait_for
from tests.compose.dockerhost import timed
from tests.compose.stack import PRODUCER_UID, Stack

pytestmark = [pytest.mark.compose, pytest.mark.timeout(900)]


# `.env` names the GPU worker's model (GENFLEET_MODEL): a dry-run producer says `--engine
# emulator`, so its work orders go to the queue worker-dry consumes (README: Docker Compose).
DRY_RUN = ("--engine", "emulator")


def write_prompts(stack: Stack, name: str, count: int) -> list[str]:
    ids = [f"{name}-{i:04d}" for i in range(count)]
    lines = [json.dumps({"id": i, "prompt": f"Say something about {i}."}) for i in ids]
    (stack.data / f"{name}.jsonl").write_text("\n".join(lines) + "\n")
    return ids


def exported_ids(stack: Stack, name: str) -> list[str]:
    path = stack.data / f"{name}.jsonl"
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    assert all(row["engine"]["kind"] == "emulator" for row in rows)
    # a long reasoning can end at the length cap with no content: a valid record
    bad = [row for row in rows if row["error"] or row["finish_reason"] not in {"stop", "length"}]
    assert not bad, json.dumps(bad[:3], indent=1)[:3000]
    return [row["id"] for row in rows]


def s3_client(stack: Stack) -> Any:
    """A client of the stack's S3 server, through its published port."""
    import boto3

    return boto3.client(
        "s3",
        endpoint_url=f"http://127.0.0.1:{stack.settings['S3_PORT']}",
        region_name="us-east-1",
        aws_access_key_id=stack.settings["S3_ACCESS_KEY_ID"],
        aws_secret_access_key=stack.settings["S3_SECRET_ACCESS_KEY"],
    )


def stored_outputs(stack: Stack, run: str) -> dict[str, Counter[str]]:
    """The ids in each output object of `run` in the stack's S3, read from the host."""
    client = s3_client(stack)
    bucket = stack.settings["S3_BUCKET"]
    listed = client.list_objects_v2(Bucket=bucket, Prefix=f"runs/{run}/outputs/")
    outputs: dict[str, Counter[str]] = {}
    for item in listed.get("Contents", []):
        body = client.get_object(Bucket=bucket, Key=item["Key"])["Body"].read()
        lines = gzip.decompress(body).splitlines()
        outputs[item["Key"]] = Counter(json.loads(line)["id"] for line in lines)
    return outputs


def run_and_export(stack: Stack, name: str, ids: list[str], batches: int) -> None:
    stack.producer("export", name, "--out", f"/data/{name}.jsonl")
    exported = exported_ids(stack, name)
    assert sorted(exported) == sorted(ids) and len(set(exported)) == len(ids)
    # one write-once object per batch, and every id in exactly one of them
    outputs = stored_outputs(stack, name)
    assert len(outputs) == batches
    owners = Counter(i for counts in outputs.values() for i in counts)
    assert owners == Counter(ids)


def test_every_service_is_up_and_healthy(stack: Stack) -> None:
    rows = [
        json.loads(line)
        for line in stack.compose("ps", "-a", "--format", "json").stdout.split("\n")
        if line.strip()
    ]
    state = {
        row["Service"]: (row["State"], row.get("Health", ""), row.get("ExitCode")) for row in rows
    }
    for service in ("redis", "s3", "worker-dry", "beat", "flower"):
        assert state[service][:2] == ("running", "healthy"), state
    assert state["bucket-init"][0] == "exited" and state["bucket-init"][2] == 0, state
    assert "worker" not in state  # the GPU worker stays off under --profile dry-run


def test_a_dataset_goes_in_and_every_id_comes_out_exactly_once(stack: Stack) -> None:
    started = time.monotonic()
    ids = write_prompts(stack, "smoke", 20)
    stack.producer("enqueue", "/data/smoke.jsonl", "--run", "smoke", *DRY_RUN)
    report = stack.wait_done("smoke", timeout_s=180)
    assert (report["prompts_done"], report["prompts_total"]) == (20, 20)
    assert report["batches_done"] == report["batches_total"] == 4
    run_and_export(stack, "smoke", ids, batches=4)
    exported = stack.data / "smoke.jsonl"
    # written by the producer as HOST_UID, with the umask's mode (not mkstemp's 0600)
    assert exported.stat().st_uid == PRODUCER_UID
    assert stat.S_IMODE(exported.stat().st_mode) == 0o644
    timed("run_20_prompts", started)


def test_a_dataset_in_s3_goes_in_and_comes_out_in_shards(stack: Stack) -> None:
    """The producer reads a folder of shards from the stack's own S3 and exports shards."""
    client = s3_client(stack)
    bucket = stack.settings["S3_BUCKET"]
    ids = [f"s3src-{i:04d}" for i in range(12)]
    rows = [json.dumps({"id": i, "prompt": f"Tell me about {i}."}).encode() for i in ids]
    client.put_object(Bucket=bucket, Key="incoming/s3src/part-0.jsonl", Body=b"\n".join(rows[:7]))
    body = gzip.compress(b"\n".join(rows[7:]))
    client.put_object(Bucket=bucket, Key="incoming/s3src/part-1.jsonl.gz", Body=body)
    stack.producer("enqueue", f"s3://{bucket}/incoming/s3src/", "--run", "s3src", *DRY_RUN)
    report = stack.wait_done("s3src", timeout_s=180)
    assert report["prompts_done"] == 12
    stack.producer("export", "s3src", "--out", "/data/s3src.jsonl", "--shard-size", "5")
    shards = [stack.data / f"s3src-{i:05d}.jsonl" for i in range(3)]
    rows_out = [json.loads(line) for path in shards for line in path.read_text().splitlines()]
    assert [len(path.read_text().splitlines()) for path in shards] == [5, 5, 2]
    assert [row["id"] for row in rows_out] == ids


def flower(stack: Stack, path: str, auth: str | None) -> tuple[int, Any]:
    request = urllib.request.Request(f"http://127.0.0.1:{stack.settings['FLOWER_PORT']}{path}")
    if auth is not None:
        request.add_header("Authorization", "Basic " + base64.b64encode(auth.encode()).decode())
    try:
        with urllib.request.urlopen(request, timeout=20) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as exc:
        return exc.code, None


def test_flower_api_needs_basic_auth_and_lists_the_workers(stack: Stack) -> None:
    assert flower(stack, "/api/workers", None)[0] == 401
    assert flower(stack, "/api/workers", "admin:wrong")[0] == 401
    auth = stack.settings["FLOWER_BASIC_AUTH"]

    def workers() -> list[str]:
        status, body = flower(stack, "/api/workers?refresh=1", auth)
        assert status == 200
        return [name for name in body if name.startswith(("gpu", "control"))]

    names = wait_for(lambda: len(workers()) >= 2 and workers(), 60, "workers in Flower", 2.0)
    assert any(n.startswith("gpu") for n in names) and any(n.startswith("control") for n in names)


def test_flower_tasks_page_shows_the_batches_in_a_browser(stack: Stack, tmp_path: Path) -> None:
    """Headless Chromium renders Flower's tasks page (its table is filled by JavaScript)."""
    chromium = shutil.which("chromium") or shutil.which("chromium-browser")
    if chromium is None:
        if os.environ.get("CI"):
            raise AssertionError("chromium is not installed")
        pytest.skip("chromium is not installed")
    flags = ["--headless", "--no-sandbox", "--disable-gpu", "--no-first-run"]
    flags += ["--disable-background-networking", "--disable-component-update", "--disable-sync"]
    auth = stack.settings["FLOWER_BASIC_AUTH"]
    page = f"http://{auth}@127.0.0.1:{stack.settings['FLOWER_PORT']}/tasks"
    dom = subprocess.run(
        [chromium, *flags, f"--user-data-dir={tmp_path / 'chromium'}"]
        + ["--virtual-time-budget=10000", "--dump-dom", page],
        capture_output=True,
        text=True,
        timeout=90,
        check=False,
    ).stdout
    assert "genfleet.generate_batch" in dom, dom[-2000:]


def test_a_worker_stopped_mid_run_resumes_and_the_run_finishes_exactly_once(stack: Stack) -> None:
    # 120 batches of 5: more than the worker holds (its engine's room, 256 prompts), so that
    # orders are still queued when it stops and finishes what it holds.
    ids = write_prompts(stack, "restart", 600)
    stack.producer("enqueue", "/data/restart.jsonl", "--run", "restart", *DRY_RUN)

    def some_done() -> dict[str, Any] | None:
        report = stack.status("restart")
        return report if report["batches_done"] >= 1 else None

    before = wait_for(some_done, 180, "the first batches of run restart", 1.0)
    assert before["state"] == "running", "the run finished before the worker could be stopped"
    started = time.monotonic()
    stack.compose("stop", "worker-dry", timeout_s=180)
    timed("stop_worker_mid_run", started)
    stopped = stack.status("restart")
    assert stopped["batches_done"] < stopped["batches_total"], stopped
    stack.compose("start", "worker-dry", timeout_s=120)
    report = stack.wait_done("restart", timeout_s=300)
    assert report["prompts_done"] == report["prompts_total"] == 600
    run_and_export(stack, "restart", ids, batches=120)


def test_an_export_into_a_folder_the_producer_cannot_write_names_the_fix(stack: Stack) -> None:
    locked: Path = stack.data / "locked"
    locked.mkdir(mode=0o755)
    os.chown(locked, 0, 0)
    result = stack.producer("export", "smoke", "--out", "/data/locked/smoke.jsonl", check=False)
    output = " ".join((result.stdout + result.stderr).split())
    assert result.returncode == 2, output
    assert "Traceback" not in output
    assert "cannot write the export into /data/locked" in output
    assert "HOST_UID" in output and "HOST_GID" in output
    assert not any(locked.iterdir())
