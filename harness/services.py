"""Services a fault test breaks on purpose, each owned by the test that uses it.

- RedisServer: a `redis-server` of the test's own (AOF on, password set) that can be shut
  down and started again on the same port and directory.
- FlakyS3: a bucket on a moto S3 server reached through FlakyProxy, a TCP proxy whose link
  the test can cut and restore, hang (bytes held, no error) and let flow again, or slow
  (every answer's chunks held a while, each call slower but inside its timeouts); moto
  loses its state when it restarts, so the outage is made at the proxy instead.
(The engine that answers 500 to marked prompts is `tests.fakes.http_engine.PoisonEngine`.)
"""

from __future__ import annotations

import contextlib
import socket
import struct
import subprocess
import threading
from pathlib import Path
from typing import Any

import redis

from genfleet.common.settings import Settings
from genfleet.common.store import Store, open_store
from harness.env import base_env
from harness.runs import fault_settings
from harness.waits import wait_for


class RedisServer:
    """A private redis-server with AOF on; `restart()` keeps its port, password and data dir."""

    def __init__(
        self, directory: Path, port: int, password: str, bind: tuple[str, ...] = ("127.0.0.1",)
    ) -> None:
        """`bind`: its addresses, the first one in `url` (`url_at` names another)."""
        self.directory = directory
        self.port = port
        self.password = password
        self.bind = bind
        self.url = self.url_at(bind[0])
        self.proc: subprocess.Popen[bytes] | None = None

    def url_at(self, address: str) -> str:
        """Its URL at `address`, one of those it binds."""
        return f"redis://:{self.password}@{address}:{self.port}/0"

    def client(self) -> redis.Redis:
        return redis.Redis.from_url(self.url, socket_connect_timeout=2)

    def start(self) -> None:
        argv = [
            "redis-server",
            "--port", str(self.port),
            "--bind", *self.bind,
            "--requirepass", self.password,
            "--appendonly", "yes",
            "--appendfsync", "always",
            "--save", "",
            "--dir", str(self.directory),
            "--logfile", str(self.directory / "redis.log"),
        ]  # fmt: skip
        self.proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)

        def answers() -> bool:
            if self.proc is not None and self.proc.poll() is not None:
                raise AssertionError(f"redis-server exited {self.proc.returncode}")
            with contextlib.suppress(redis.RedisError), self.client() as client:
                return bool(client.ping())
            return False

        wait_for(answers, 20, f"redis-server on port {self.port}")

    def shutdown(self) -> None:
        """SHUTDOWN (which fsyncs the AOF), then wait for the process to exit."""
        with contextlib.suppress(redis.ConnectionError), self.client() as client:
            client.shutdown()
        assert self.proc is not None
        self.proc.wait(timeout=20)

    def restart(self) -> None:
        self.shutdown()
        self.start()

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=10)


class FlakyProxy:
    """A TCP proxy to `upstream`; `cut()` resets every connection and refuses new ones.

    While cut, a connection is accepted and reset at once (SO_LINGER 0), so a client sees a
    connection error, as with an S3 endpoint that is down or a load balancer that drops it.
    """

    def __init__(self, upstream: tuple[str, int]) -> None:
        self.upstream = upstream
        self.refused = 0
        self.held = 0  # chunks that arrived while hung: calls that felt the hang
        self.reply_delay_s = 0.0  # `slow()`: each chunk of an answer is held this long
        self.delayed = 0  # answer chunks held by `slow()`
        self._up = threading.Event()
        self._up.set()
        self._flowing = threading.Event()
        self._flowing.set()
        self._closed = threading.Event()
        self._lock = threading.Lock()
        self._sockets: set[socket.socket] = set()
        self._listener = socket.socket()
        self._listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._listener.bind(("127.0.0.1", 0))
        self._listener.listen(128)
        self._listener.settimeout(0.2)
        self.port = int(self._listener.getsockname()[1])
        self._thread = threading.Thread(target=self._accept, name="flaky-proxy", daemon=True)
        self._thread.start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def cut(self) -> None:
        self._up.clear()
        with self._lock:
            sockets, self._sockets = list(self._sockets), set()
        for sock in sockets:
            _reset(sock)

    def restore(self) -> None:
        self._up.set()

    def hang(self) -> None:
        """Hold every byte in both directions: calls hang (no error) until `flow()`."""
        self._flowing.clear()

    def flow(self) -> None:
        self._flowing.set()

    def slow(self, delay_s: float) -> None:
        """Hold each chunk of the upstream's answers `delay_s` (0: full speed again): a store
        that answers every call, late. Requests pass at once."""
        self.reply_delay_s = delay_s

    def close(self) -> None:
        self._closed.set()
        self._flowing.set()
        self.cut()
        self._thread.join(timeout=5)
        self._listener.close()

    def _accept(self) -> None:
        while not self._closed.is_set():
            try:
                conn, _ = self._listener.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            if not self._up.is_set():
                self.refused += 1
                _reset(conn)
                continue
            try:
                upstream = socket.create_connection(self.upstream, timeout=5)
            except OSError:
                _reset(conn)
                continue
            with self._lock:
                self._sockets.update((conn, upstream))
            for src, dst, answers in ((conn, upstream, False), (upstream, conn, True)):
                threading.Thread(target=self._pump, args=(src, dst, answers), daemon=True).start()

    def _pump(self, src: socket.socket, dst: socket.socket, answers: bool = False) -> None:
        with contextlib.suppress(OSError):
            src.settimeout(None)
            while data := src.recv(65536):
                if not self._flowing.is_set():
                    with self._lock:
                        self.held += 1
                while not self._flowing.wait(0.2):
                    if self._closed.is_set():
                        return
                if answers and self.reply_delay_s > 0:
                    with self._lock:
                        self.delayed += 1
                    if self._closed.wait(self.reply_delay_s):
                        return
                dst.sendall(data)
        for sock in (src, dst):
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
        with self._lock:
            self._sockets.discard(src)


def _reset(sock: socket.socket) -> None:
    """Drop a connection now, whoever is blocked on it.

    `shutdown` first: a bare `close` does not wake a pump thread blocked in `recv` on the
    same socket, and the connection would then stay open, silent, until the client's read
    timeout. Linger 0 makes the close a reset rather than a clean end of stream.
    """
    with contextlib.suppress(OSError):
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    with contextlib.suppress(OSError):
        sock.shutdown(socket.SHUT_RDWR)
    with contextlib.suppress(OSError):
        sock.close()


class FlakyS3:
    """A bucket on a moto server of this test, reached through a proxy that can be cut."""

    def __init__(self, direct_url: str, proxy: FlakyProxy, bucket: str) -> None:
        self.direct_url = direct_url  # for the test's own checks, never cut
        self.proxy = proxy
        self.bucket = bucket
        self.store_url = f"s3://{bucket}/runs"

    @property
    def endpoint_url(self) -> str:
        return self.proxy.url

    def worker_env(self, redis_url: str, **knobs: Any) -> dict[str, str]:
        """The environment of workers that reach the bucket through the proxy."""
        return base_env(redis_url, self.store_url, s3_endpoint_url=self.endpoint_url, **knobs)

    def settings(self, redis_url: str, direct: bool = False) -> Settings:
        """The producer's settings through the proxy, or (`direct`) the test's own view of the
        bucket around it, which sees through an outage."""
        endpoint = self.direct_url if direct else self.endpoint_url
        return fault_settings(redis_url, self.store_url, s3_endpoint_url=endpoint)

    def store(self) -> Store:
        """The bucket as the test sees it, around the proxy."""
        return open_store(self.store_url, self.direct_url, "us-east-1")
