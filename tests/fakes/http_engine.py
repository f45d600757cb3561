"""An OpenAI-compatible engine over real HTTP that fails on purpose: 500 to every prompt
holding POISON while `poison`, and to every prompt while `broken` (batches whose requests all
fail, an engine that breaks and mends)."""

from __future__ import annotations

import http.server
import sys
import uuid
from typing import Any

import orjson

POISON = "POISON"


class PoisonEngine(http.server.ThreadingHTTPServer):
    """An OpenAI-compatible engine that answers 500 to every marked prompt while `poison`, and
    to every prompt while `broken`."""

    daemon_threads = True

    def __init__(self) -> None:
        super().__init__(("127.0.0.1", 0), _PoisonEngineHandler)
        self.poison = True
        self.broken = False
        self.failed_requests = 0
        self.url = f"http://127.0.0.1:{self.server_address[1]}"

    def handle_error(self, request: Any, client_address: Any) -> None:
        """A client that hung up before its answer is the client's business, not this
        engine's: no traceback on stderr for it. Anything else is still printed."""
        if not isinstance(sys.exc_info()[1], ConnectionError):
            super().handle_error(request, client_address)


class _PoisonEngineHandler(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server: PoisonEngine

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - base signature
        pass

    def _reply(self, status: int, body: dict[str, Any]) -> None:
        data = orjson.dumps(body)
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self) -> None:  # noqa: N802 - http.server's naming
        if self.path == "/health":
            self._reply(200, {})
        elif self.path == "/server_info":
            self._reply(200, {"max_running_requests": 16, "version": "fake"})
        else:
            self._reply(404, {"error": {"message": "not found", "type": "NotFound"}})

    def do_POST(self) -> None:  # noqa: N802 - http.server's naming
        body = orjson.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))))
        text = " ".join(str(m.get("content")) for m in body.get("messages", []))
        if self.server.broken or (self.server.poison and POISON in text):
            self.server.failed_requests += 1
            self._reply(500, {"error": {"message": "internal error", "type": "InternalError"}})
            return
        self._reply(
            200,
            {
                "id": uuid.uuid4().hex,
                "model": body.get("model"),
                "choices": [
                    {
                        "index": 0,
                        "message": {"role": "assistant", "content": f"echo: {text[:40]}"},
                        "finish_reason": "stop",
                    }
                ],
                "usage": {"prompt_tokens": len(text) // 4, "completion_tokens": 4},
            },
        )
