"""Record what real SGLang answers, as golden files for the emulator's contract tests.

    python bench/real_sglang/record_golden.py --model /tmp/m/q35 --out DIR

On the GPU machine (bench/real_sglang/device.sh, step `golden`). The engine is started the way
a worker starts it: genfleet's own argv (`sglang_launch`, MTP on, reasoning parser) under
genfleet's `EngineSupervisor`, with an API key (through `--config`, as the worker passes it),
a small running cap and `--max-queued-requests` so a full queue can be seen. Every answer is
kept as SGLang sent it (status, content type, body); `tests/golden/README.md` says what each
file holds. The model is random: the texts are noise, the shapes and messages are the point.
"""

from __future__ import annotations

import argparse
import json
import threading
import time
from pathlib import Path
from typing import Any

import httpx

from genfleet.common.settings import Settings
from genfleet.workers.engine.kinds import engine_launch
from genfleet.workers.engine.preflight import checkpoint_arch
from genfleet.workers.engine.supervisor import EngineSupervisor

API_KEY = "golden-key"
CAP = 4
QUEUE = 2


def answer(response: httpx.Response) -> dict[str, Any]:
    """Status, content type and body (JSON when it parses, else text) of one response."""
    try:
        body: Any = response.json()
    except ValueError:
        body = response.text
    return {
        "status": response.status_code,
        "content_type": response.headers.get("content-type"),
        "body": body,
    }


class Recorded(dict[str, Any]):
    """Written to disk as each entry is set: a probe that fails later loses nothing before it.

    Without `name` every entry is its own `<key>.json`; with it the whole dict is `<name>.json`.
    """

    def __init__(self, out: Path, name: str | None = None) -> None:
        super().__init__()
        self.out, self.name = out, name

    def __setitem__(self, key: str, value: Any) -> None:
        super().__setitem__(key, value)
        target, data = (key, value) if self.name is None else (self.name, dict(self))
        text = json.dumps(data, indent=1, sort_keys=True, default=str) + "\n"
        (self.out / f"{target}.json").write_text(text)


def attempt(call: Any) -> dict[str, Any]:
    """`answer(call())`, or what went wrong instead (a timeout is a finding too)."""
    try:
        return answer(call())
    except httpx.HTTPError as exc:
        return {"exception": f"{type(exc).__name__}: {exc}"}


def watch_health(url: str, stop: threading.Event, seen: list[dict[str, Any]]) -> None:
    """Every change of /health (None: connection refused), with seconds since the start."""
    started = time.monotonic()
    last: Any = "unset"
    while not stop.is_set():
        try:
            r = httpx.get(f"{url}/health", timeout=5)
            now: Any = [r.status_code, r.text]
        except httpx.TransportError as exc:
            now = [None, type(exc).__name__]
        if now != last:
            seen.append({"t_s": round(time.monotonic() - started, 2), "health": now})
            last = now
        stop.wait(0.25)


def hold_stream(
    url: str, auth: dict[str, str], body: dict[str, Any], stop: threading.Event
) -> None:
    """Keep one streamed request open (reading it) until `stop` is set or it ends."""
    try:
        with httpx.stream(
            "POST", f"{url}/v1/chat/completions", json=body, headers=auth, timeout=300
        ) as r:
            for _ in r.iter_bytes():
                if stop.is_set():
                    return
    except httpx.HTTPError as exc:
        print(f"a load stream ended: {exc!r}")


def gauge(metrics: str, name: str) -> float:
    """The sum of `sglang:<name>` over its label sets in a /metrics text (0 when absent)."""
    total = 0.0
    for line in metrics.splitlines():
        if line.startswith((f"sglang:{name}{{", f"sglang:{name} ")):
            total += float(line.rsplit(" ", 1)[1])
    return total


def chat_body(content: str = "Explain hash maps in 20 words.", **extra: Any) -> dict[str, Any]:
    return {"messages": [{"role": "user", "content": content}], "max_tokens": 48, **extra}


def record(url: str, model: str, out: Path) -> None:
    auth = {"Authorization": f"Bearer {API_KEY}"}
    c = httpx.Client(base_url=url, headers=auth, timeout=120)
    files = Recorded(out)
    files["server_info"] = c.get("/server_info").json()
    files["models"] = {
        "v1_models": answer(c.get("/v1/models")),
        "model_info": answer(c.get("/model_info")),
        "v1_models_missing": answer(c.get("/v1/models/nope")),
    }
    files["chat"] = answer(c.post("/v1/chat/completions", json=chat_body(model=model)))
    files["chat_length"] = answer(
        c.post("/v1/chat/completions", json=chat_body(model=model, max_completion_tokens=3))
    )
    files["chat_thinking_off"] = answer(
        c.post(
            "/v1/chat/completions",
            json=chat_body(model=model, chat_template_kwargs={"enable_thinking": False}),
        )
    )
    stream = chat_body(model=model, stream=True, stream_options={"include_usage": True})
    with c.stream("POST", "/v1/chat/completions", json=stream) as r:
        (out / "chat_stream.sse").write_text(r.read().decode())
        files["chat_stream_headers"] = {
            "status": r.status_code,
            "content_type": r.headers.get("content-type"),
        }
    gen = {"text": "The capital of France is", "sampling_params": {"max_new_tokens": 16}}
    files["generate"] = answer(c.post("/generate", json=gen))
    with c.stream("POST", "/generate", json=gen | {"stream": True}) as r:
        (out / "generate_stream.sse").write_text(r.read().decode())

    errors = Recorded(out, "errors")
    raw_json = {"Content-Type": "application/json", **auth}
    errors["bad_json"] = answer(
        c.post("/v1/chat/completions", content=b"{not json", headers=raw_json)
    )
    errors["wrong_content_type"] = answer(
        c.post(
            "/v1/chat/completions", content=b"{}", headers={"Content-Type": "text/plain", **auth}
        )
    )
    errors["empty_messages"] = answer(c.post("/v1/chat/completions", json={"messages": []}))
    errors["top_p_out_of_range"] = answer(c.post("/v1/chat/completions", json=chat_body(top_p=1.5)))
    errors["unknown_model"] = answer(c.post("/v1/chat/completions", json=chat_body(model="nope")))
    context = int(files["server_info"].get("context_length") or 32768)
    long = "hash " * (2 * context)
    errors["too_long"] = answer(c.post("/v1/chat/completions", json=chat_body(long)))
    errors["too_long_stream"] = answer(
        c.post("/v1/chat/completions", json=chat_body(long, stream=True))
    )
    errors["max_tokens_over_context"] = answer(
        c.post("/v1/chat/completions", json=chat_body(max_tokens=context + 100))
    )
    errors["generate_too_long"] = answer(c.post("/generate", json={"text": long}))
    for name, headers in (("wrong_key", {"Authorization": "Bearer wrong"}), ("no_key", {})):
        errors[f"{name}_chat"] = answer(
            httpx.post(f"{url}/v1/chat/completions", json=chat_body(), headers=headers)
        )
        errors[f"{name}_models"] = answer(httpx.get(f"{url}/v1/models", headers=headers))
        errors[f"{name}_health"] = answer(httpx.get(f"{url}/health", headers=headers))
        errors[f"{name}_metrics"] = answer(httpx.get(f"{url}/metrics", headers=headers))

    # A full queue: CAP running + QUEUE waiting long streams (each read in a thread of its
    # own until told to stop), then one more request of each kind.
    long_stream = chat_body(stream=True, max_tokens=4000, ignore_eos=True)
    health_under_load: list[Any] = []
    stop = threading.Event()
    readers = [
        threading.Thread(target=hold_stream, args=(url, auth, long_stream, stop), daemon=True)
        for _ in range(CAP + QUEUE + 2)
    ]
    try:
        for reader in readers:
            reader.start()
            time.sleep(0.3)  # in order: the first CAP run, the rest wait
        deadline = time.monotonic() + 20
        while (
            time.monotonic() < deadline and gauge(c.get("/metrics").text, "num_queue_reqs") < QUEUE
        ):
            time.sleep(0.2)
        (out / "metrics_busy.prom").write_text(c.get("/metrics").text)
        files["server_info_busy"] = c.get("/server_info").json()
        quick = httpx.Client(base_url=url, headers=auth, timeout=20)
        errors["queue_full"] = attempt(
            lambda: quick.post("/v1/chat/completions", json=long_stream | {"stream": False})
        )
        errors["queue_full_stream"] = attempt(
            lambda: quick.post("/v1/chat/completions", json=long_stream)
        )
        gen_body = {"text": "x", "sampling_params": {"max_new_tokens": 8}}
        errors["queue_full_generate"] = attempt(lambda: quick.post("/generate", json=gen_body))
        for _ in range(3):
            health_under_load.append(attempt(lambda: quick.get("/health")))
        files["health_under_load"] = health_under_load
    finally:
        stop.set()
        for reader in readers:
            reader.join(timeout=30)
    time.sleep(2)
    (out / "metrics.prom").write_text(c.get("/metrics").text)
    files["health_after"] = {
        "health": answer(httpx.get(f"{url}/health")),
        "health_generate": answer(httpx.get(f"{url}/health_generate", timeout=60)),
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--port", type=int, default=30400)
    parser.add_argument("--engine", default="sglang", help="emulator: try the recorder here")
    parser.add_argument("--extra-args", default="--sampling-backend pytorch --grammar-backend none")
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    settings = Settings(
        model=args.model,
        engine=args.engine,
        attention_backend="triton",
        mem_fraction_static=0.6,
        max_running_requests=CAP,
        engine_api_key=API_KEY,
        engine_extra_args=f"{args.extra_args} --max-queued-requests {QUEUE}",
    )
    launch = engine_launch(settings, args.port, arch=checkpoint_arch(args.model))
    assert launch is not None
    (out / "argv.json").write_text(json.dumps(launch.argv, indent=1) + "\n")
    supervisor = EngineSupervisor(
        launch, gpus="0", log_path=out / "engine.log", startup_timeout_s=420, restart_budget=0
    )
    stop = threading.Event()
    seen: list[dict[str, Any]] = []
    watcher = threading.Thread(target=watch_health, args=(launch.base_url, stop, seen), daemon=True)
    watcher.start()
    started = time.monotonic()
    try:
        supervisor.start()
        ready_s = time.monotonic() - started
        time.sleep(1.0)
        stop.set()
        watcher.join()
        (out / "health_startup.json").write_text(
            json.dumps({"ready_s": round(ready_s, 1), "changes": seen}, indent=1) + "\n"
        )
        record(launch.base_url, settings.served_model_name or args.model, out)
    finally:
        stop.set()
        supervisor.stop()
    print(f"golden files in {out}: {sorted(p.name for p in out.iterdir())}")


if __name__ == "__main__":
    main()
