"""The emulator's request log as a soak reads it (harness/resends.py, harness/redone.py): each
/generate prompt's start (its prompt's ids hashed, the output tokens it carried in) and its end
(what it generated), and beside the log the tokens the engine process stepped, which still
holds what a request killed with its engine drew."""

from __future__ import annotations

import json
import os
import shutil
import signal
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest

from genfleet.workers.engine.emulator.sim.stepper import tokens_file
from harness.waits import wait_for
from tests.support.emulator import StartEmulator

pytestmark = pytest.mark.integration

TEMPLATES = Path(__file__).resolve().parents[2] / "data" / "chat_templates"
CHAT = [{"role": "user", "content": "Tell me about the sea."}]


def lines(log: Path) -> list[dict[str, Any]]:
    return [orjson.loads(line) for line in log.read_bytes().splitlines()]


def stepped(log: Path, pid: int) -> int:
    return int(Path(tokens_file(str(log), pid)).read_bytes())


def start(start_emulator: StartEmulator, tmp_path: Path, **env: str) -> tuple[str, Path, int]:
    model = tmp_path / "qwen3"
    model.mkdir()
    shutil.copy(TEMPLATES / "qwen3.jinja", model / "chat_template.jinja")
    log = tmp_path / "requests.jsonl"
    emulator = start_emulator(
        "--model-path",
        str(model),
        "--incremental-streaming-output",
        env={"GENFLEET_EMULATOR_REQUEST_LOG": str(log), **env},
    )
    return emulator.base_url, log, emulator.proc.pid


def generate(url: str, ids: list[int], max_new: int, stop_after: int | None = None) -> list[int]:
    """Stream /generate; the output ids received (all, or the first chunks holding at least
    `stop_after` when that is given; the stream is left open then)."""
    body = {"input_ids": ids, "stream": True, "sampling_params": {"max_new_tokens": max_new}}
    out: list[int] = []
    client = httpx.Client(base_url=url, timeout=30)
    response = client.send(client.build_request("POST", "/generate", json=body), stream=True)
    for line in response.iter_lines():
        if line.startswith("data: {"):
            out += json.loads(line[len("data: ") :])["output_ids"]
            if stop_after is not None and len(out) >= stop_after:
                return out  # the stream stays open: the engine dies with it in flight
    response.close()
    client.close()
    return out


def test_each_generate_prompt_logs_its_start_and_end_and_the_tokens_file_adds_them_up(
    start_emulator: StartEmulator, tmp_path: Path
) -> None:
    url, log, pid = start(start_emulator, tmp_path)
    prompt = httpx.post(f"{url}/v1/tokenize", json={"model": "m", "messages": CHAT}).json()
    whole = generate(url, prompt["tokens"], 200)
    rest = generate(url, prompt["tokens"] + whole[:30], 170)  # the same answer, going on at 30
    assert rest == whole[30:]
    first, first_end, second, second_end = lines(log)
    assert first["route"] == second["route"] == "generate"
    assert first["prompt"] == second["prompt"]  # one answer's requests share the prompt's name
    assert (first["drawn"], second["drawn"]) == (0, 30)
    assert first["pid"] == second["pid"] == pid
    assert (first_end["outcome"], first_end["id"]) == ("end", first["id"])
    assert (first_end["generated"], second_end["generated"]) == (len(whole), len(rest))
    assert stepped(log, pid) == len(whole) + len(rest)


def test_the_tokens_file_holds_what_a_request_killed_with_its_engine_drew(
    start_emulator: StartEmulator, tmp_path: Path
) -> None:
    slow = {"GENFLEET_EMULATOR_TIME_SCALE": "1", "GENFLEET_EMULATOR_MEAN_COMPLETION_TOKENS": "4000"}
    url, log, pid = start(start_emulator, tmp_path, **slow)
    prompt = httpx.post(f"{url}/v1/tokenize", json={"model": "m", "messages": CHAT}).json()
    received = generate(url, prompt["tokens"], 4000, stop_after=50)
    os.kill(pid, signal.SIGKILL)
    wait_for(lambda: not Path(f"/proc/{pid}").exists() or _zombie(pid), 10, "the engine gone")
    (start_line,) = lines(log)  # no end line: the request died in flight
    assert start_line["outcome"] == "ok"
    assert stepped(log, pid) >= len(received) >= 50


def _zombie(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except OSError:
        return True
