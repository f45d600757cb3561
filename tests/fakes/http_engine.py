"""An OpenAI-compatible engine over real HTTP whose answers the test scripts: `ScriptedEngine`.

In the test's process it answers each chat request as its `script` says for the prompt's text
and how often that text was asked before, and each GET as `routes` says (`/health`,
`/server_info`, `/genfleet/power`, …); it counts what it was asked and how many requests it
held at once. `PoisonEngine` is the one that answers 500 to marked prompts, or to every prompt
while `broken`.

Run as a program (`python tests/fakes/http_engine.py PORT [options]`, `engine_argv`) it is the
"engine" process a supervisor starts: it can wait before it binds, print lines, dump what it
was started with, and die shortly after it starts while a marker file exists. It then needs
nothing but the standard library and orjson (the supervisor gives it a bare environment).
With `--die-on TEXT` it is instead an engine that streams its answers (SSE, as SGLang does)
and dies on receipt of a prompt holding TEXT, in the manner `--die-when` and `--die-how` say
(`die_on_receipt`), printing no error line: an engine genfleet knows nothing about.
"""

from __future__ import annotations

import argparse
import http.server
import os
import resource
import signal
import socket
import sys
import threading
import time
import uuid
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import orjson

# (status, body, headers): a body of bytes goes out as it is, anything else as JSON
Answer = tuple[int, Any, dict[str, str]]
# the answer to the n-th request (from 0) carrying a prompt's text
Script = Callable[[str, int], Answer]
POISON = "POISON"


def ok(text: str, finish: str = "stop") -> Answer:
    """A completion answering `text` ("answer to TEXT"), with usage and a request id."""
    body = {
        "id": f"rid-{text}",
        "model": "m",
        "choices": [
            {"index": 0, "message": {"content": f"answer to {text}"}, "finish_reason": finish}
        ],
        "usage": {"prompt_tokens": 3, "completion_tokens": 5, "reasoning_tokens": 2},
    }
    return 200, body, {}


def error(status: int, message: str, **headers: str) -> Answer:
    """An OpenAI-style error answer."""
    return status, {"error": {"message": message}}, headers


class ScriptedEngine(http.server.ThreadingHTTPServer):
    """An engine on a loopback port answering chat requests as `script` says; `start()` serves
    it on a thread of its own, `stop()` ends it."""

    daemon_threads = True
    # a client opening many connections at once is not left to a SYN retry (socketserver's
    # backlog is 5; aiohttp's and SGLang's are far larger)
    request_queue_size = 128

    def __init__(self, script: Script = lambda text, n: ok(text), port: int = 0) -> None:
        super().__init__(("127.0.0.1", port), _Handler)
        self.script = script
        self.routes: dict[str, Answer] = {
            "/": (200, {}, {}),
            "/health": (200, {}, {}),
            "/server_info": (200, {"max_running_requests": 16, "version": "fake"}, {}),
        }
        self.delay_s = 0.0  # how long each answer takes
        self.slow: dict[str, float] = {}  # prompt text → seconds its answer takes instead
        self.seen: Counter[str] = Counter()
        self.bodies: list[dict[str, Any]] = []
        self.running = 0
        self.most_running = 0
        self.port = int(self.server_address[1])
        self.url = f"http://127.0.0.1:{self.port}"
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None

    def start(self) -> ScriptedEngine:
        self._thread = threading.Thread(target=self.serve_forever, name="engine", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        if self._thread is not None:
            self.shutdown()
            self._thread.join(timeout=5)
        self.server_close()

    def answer(self, body: dict[str, Any]) -> Answer:
        """The answer to a chat request: the script's, for the text of its messages."""
        text = " ".join(str(m.get("content")) for m in body.get("messages", []))
        with self._lock:
            self.bodies.append(body)
            n = self.seen[text]
            self.seen[text] += 1
            self.running += 1
            self.most_running = max(self.most_running, self.running)
        try:
            time.sleep(self.slow.get(text, self.delay_s))
            return self.script(text, n)
        finally:
            with self._lock:
                self.running -= 1

    def handle_error(self, request: Any, client_address: Any) -> None:
        """A client that hung up before its answer is the client's business, not this
        engine's: no traceback on stderr for it. Anything else is still printed."""
        if not isinstance(sys.exc_info()[1], ConnectionError):
            super().handle_error(request, client_address)


class PoisonEngine(ScriptedEngine):
    """Answers 500 to every prompt holding POISON while `poison`, and to every prompt while
    `broken` (batches whose requests all fail, an engine that breaks and mends); else echoes."""

    def __init__(self) -> None:
        super().__init__()
        self.poison = True
        self.broken = False
        self.failed_requests = 0

    def answer(self, body: dict[str, Any]) -> Answer:
        text = " ".join(str(m.get("content")) for m in body.get("messages", []))
        if self.broken or (self.poison and POISON in text):
            with self._lock:
                self.failed_requests += 1
            return 500, {"error": {"message": "internal error", "type": "InternalError"}}, {}
        message = {"role": "assistant", "content": f"echo: {text[:40]}"}
        return (
            200,
            {
                "id": uuid.uuid4().hex,
                "model": body.get("model"),
                "choices": [{"index": 0, "message": message, "finish_reason": "stop"}],
                "usage": {"prompt_tokens": len(text) // 4, "completion_tokens": 4},
            },
            {},
        )


class _Handler(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server: ScriptedEngine

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - base signature
        pass

    def _reply(self, answer: Answer) -> None:
        status, body, headers = answer
        data = body if isinstance(body, bytes) else orjson.dumps(body)
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        for name, value in headers.items():
            self.send_header(name, value)
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self) -> None:  # noqa: N802 - http.server's naming
        not_found: Answer = (404, {"error": {"message": "not found", "type": "NotFound"}}, {})
        self._reply(self.server.routes.get(self.path, not_found))

    def do_POST(self) -> None:  # noqa: N802 - http.server's naming
        body = orjson.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))))
        self._reply(self.server.answer(body))


def engine_argv(port: int, *options: str) -> list[str]:
    """The argv of this engine as a process on `port` (options: see `main`)."""
    return [sys.executable, str(Path(__file__).resolve()), str(port), *options]


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(description="a scripted engine process")
    parser.add_argument("port", type=int)
    parser.add_argument("--delay-s", type=float, default=0.0, help="wait before binding")
    parser.add_argument("--say", action="append", default=[], help="print, {port} filled in")
    parser.add_argument("--dump", help="write env, argv and the --config file's text here")
    parser.add_argument("--crash-while", help="while this file exists, die after --crash-after-s")
    parser.add_argument("--crash-after-s", type=float, default=0.3)
    parser.add_argument("--last-words", action="append", default=[], help="printed as it dies")
    parser.add_argument("--config", help="the config file a supervisor passes (read by --dump)")
    parser.add_argument("--die-on", help="stream answers, and die on a prompt holding this")
    parser.add_argument("--die-when", choices=DIE_WHEN, default="received")
    parser.add_argument("--die-how", choices=sorted(DIE_HOW), default="1")
    parser.add_argument("--answer-s", type=float, default=0.4, help="a streamed answer's length")
    parser.add_argument("--sends", help="append one line per chat request received here")
    args, _ = parser.parse_known_args(argv)  # and whatever else the supervisor adds
    time.sleep(args.delay_s)
    for line in args.say:
        print(line.format(port=args.port), flush=True)
    if args.dump:
        seen: dict[str, Any] = {"env": dict(os.environ), "argv": sys.argv}
        if args.config:
            seen["config"] = Path(args.config).read_text()
            seen["mode"] = os.stat(args.config).st_mode & 0o777
        Path(args.dump).write_bytes(orjson.dumps(seen))
    if args.crash_while:
        threading.Thread(target=_crash, args=(args,), daemon=True).start()
    if args.die_on:
        DyingEngine(args).serve_forever()
    ScriptedEngine(port=args.port).serve_forever()


def _crash(args: argparse.Namespace) -> None:
    time.sleep(args.crash_after_s)
    if os.path.exists(args.crash_while):
        for line in args.last_words:
            print(line, flush=True)
        os._exit(1)


# When an engine dies against the request that kills it: on receipt, before any answer
# (`received`); after the answer's headers (`headers`); after its first event, the assistant's
# role with no text yet (`role`); after closing the connection, so the client sees it closed
# first and the process exits a moment later (`closed`).
DIE_WHEN = ("received", "headers", "role", "closed")
# How it exits: with a code, or a signal it raises on itself (a fault, an abort).
DIE_HOW = {"0": 0, "1": 1, "segv": -signal.SIGSEGV, "abrt": -signal.SIGABRT}


def die(how: str) -> None:
    """Exit at once: code 0 or 1, or by SIGSEGV / SIGABRT (no core file)."""
    code = DIE_HOW[how]
    if code >= 0:
        os._exit(code)
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    os.kill(os.getpid(), -code)  # both keep their default action in Python: the process ends
    time.sleep(5)
    os._exit(99)  # never reached


class DyingEngine(http.server.ThreadingHTTPServer):
    """`--die-on`: streams every answer (the role, then one chunk of text `answer_s` / 4 after
    it arrives, then the finish) and dies on a prompt holding `die_on`; appends
    `<monotonic> <pid> <text>` to `--sends` for each chat request first (written before it
    dies)."""

    daemon_threads = True
    request_queue_size = 128

    def __init__(self, args: argparse.Namespace) -> None:
        super().__init__(("127.0.0.1", args.port), _StreamHandler)
        self.args = args
        self.lock = threading.Lock()

    def handle_error(self, request: Any, client_address: Any) -> None:
        """Silent: an engine that says nothing, not even of a client that hung up."""


def _event(data: dict[str, Any] | str) -> bytes:
    body = data if isinstance(data, str) else orjson.dumps(data).decode()
    return f"data: {body}\n\n".encode()


def _chunk(data: bytes) -> bytes:
    return f"{len(data):x}\r\n".encode() + data + b"\r\n"


class _StreamHandler(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server: DyingEngine

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - base signature
        pass

    def do_GET(self) -> None:  # noqa: N802 - http.server's naming
        data = b"{}"
        self.send_response(200 if self.path in ("/health", "/", "/v1/models") else 404)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_POST(self) -> None:  # noqa: N802 - http.server's naming
        args = self.server.args
        body = orjson.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))))
        text = " ".join(str(m.get("content")) for m in body.get("messages", []))
        if args.sends:
            with self.server.lock, open(args.sends, "a") as sends:
                sends.write(f"{time.monotonic():.4f} {os.getpid()} {text}\n")
        poison = args.die_on in text
        if poison and args.die_when == "received":
            die(args.die_how)
        if poison and args.die_when == "closed":
            self.connection.shutdown(socket.SHUT_RDWR)
            time.sleep(1.0)
            die(args.die_how)
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()
        self.wfile.flush()
        if poison and args.die_when == "headers":
            die(args.die_how)
        rid = uuid.uuid4().hex
        base = {"id": rid, "model": body.get("model"), "object": "chat.completion.chunk"}
        role = {"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}
        self.wfile.write(_chunk(_event({**base, "choices": [role]})))
        self.wfile.flush()
        if poison:
            die(args.die_how)
        time.sleep(args.answer_s / 4)
        usage = {"prompt_tokens": len(text) // 4, "completion_tokens": 4, "total_tokens": 0}
        words = {"index": 0, "delta": {"content": f"echo: {text[:40]}"}, "finish_reason": None}
        self.wfile.write(_chunk(_event({**base, "choices": [words], "usage": usage})))
        self.wfile.flush()
        time.sleep(args.answer_s * 3 / 4)
        end = {"index": 0, "delta": {}, "finish_reason": "stop"}
        self.wfile.write(_chunk(_event({**base, "choices": [end], "usage": usage})))
        self.wfile.write(_chunk(_event("[DONE]")) + b"0\r\n\r\n")
        self.wfile.flush()


if __name__ == "__main__":
    main(sys.argv[1:])
