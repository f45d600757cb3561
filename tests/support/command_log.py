"""What a Redis server runs while a test watches (`MONITOR`)."""

from __future__ import annotations

import threading
import uuid

import redis


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
