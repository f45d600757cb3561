"""The Redis seam: one connection helper that maps connection failures to a clear error, and
the commands the worker's batch path uses, as a protocol.

`RedisCommands` is what the ledger (common/ledger.py), `workers.batch.execute`, the generate
task and the lease reaper need from Redis. `redis.Redis` satisfies it; so does the in-memory
fake the unit tests use, and one contract test (tests/common/test_redis_contract.py) runs
against both, so the fake is trusted only as far as it behaves like the real server. A command the
batch path starts using is added here, to the fake and to the contract test.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any, Protocol

import redis

from genfleet.common.errors import BrokerUnavailable
from genfleet.common.settings import Settings, redact_url

Value = bytes | str | int | float


class RedisPipeline(Protocol):
    """Commands queued by `pipeline()` and sent together by `execute()` (MULTI/EXEC)."""

    def append(self, name: str, value: Value, /) -> Any: ...

    def delete(self, *names: str) -> Any: ...

    def hset(self, name: str, key: str, value: Value, /) -> Any: ...

    def hdel(self, name: str, /, *keys: str) -> Any: ...

    def hincrby(self, name: str, key: str, amount: int = 1, /) -> Any: ...

    def hincrbyfloat(self, name: str, key: str, amount: float = 1.0, /) -> Any: ...

    def srem(self, name: str, /, *values: str) -> Any: ...

    def zadd(self, name: str, mapping: Mapping[str, float], /) -> Any: ...

    def zremrangebyscore(self, name: str, min: float | str, max: float | str, /) -> Any: ...

    def zrem(self, name: str, /, *values: Value) -> Any: ...

    def pexpire(self, name: str, time: int, /) -> Any: ...

    def execute(self) -> list[Any]: ...


class RedisCommands(Protocol):
    """The Redis commands of the batch path and the ledger; replies are bytes, as from a
    default client."""

    def set(
        self, name: str, value: Value, /, *, px: int | None = None, nx: bool = False
    ) -> Any: ...

    def get(self, name: str, /) -> Any: ...

    def append(self, name: str, value: Value, /) -> Any: ...

    def delete(self, *names: str) -> Any: ...

    def exists(self, *names: str) -> Any: ...

    def hset(self, name: str, key: str, value: Value, /) -> Any: ...

    def hsetnx(self, name: str, key: str, value: Value, /) -> Any: ...

    def hdel(self, name: str, /, *keys: str) -> Any: ...

    def hincrby(self, name: str, key: str, amount: int = 1, /) -> Any: ...

    def hget(self, name: str, key: str, /) -> Any: ...

    def hgetall(self, name: str, /) -> Any: ...

    def hkeys(self, name: str, /) -> Any: ...

    def hlen(self, name: str, /) -> Any: ...

    def hscan_iter(self, name: str, /, *, count: int | None = None) -> Iterator[Any]: ...

    def sadd(self, name: str, /, *values: str) -> Any: ...

    def srem(self, name: str, /, *values: str) -> Any: ...

    def smembers(self, name: str, /) -> Any: ...

    def sscan_iter(self, name: str, /, *, count: int | None = None) -> Iterator[Any]: ...

    def scard(self, name: str, /) -> Any: ...

    def zrem(self, name: str, /, *values: Value) -> Any: ...

    def pipeline(self) -> RedisPipeline: ...

    def eval(self, script: str, numkeys: int, /, *keys_and_args: str) -> Any: ...

    def time(self) -> Any: ...


def server_time(client: RedisCommands) -> float:
    """Redis's clock (TIME), in seconds since the epoch: the one clock every host of a fleet
    reads alike. A time one process writes and another compares with its own "now" (when a
    batch was claimed, against the reaper's pass) is taken here, never from a host's wall
    clock: a worker whose clock runs ten minutes ahead must not hide its batch from the
    reaper for ten minutes."""
    seconds, micros = client.time()
    return int(seconds) + int(micros) / 1_000_000


def _satisfies(client: redis.Redis) -> RedisCommands:
    return client  # mypy checks here that redis.Redis is a RedisCommands


def connect(
    settings: Settings,
    check: bool = True,
    timeout_s: float | None = None,
    client_name: str | None = None,
) -> redis.Redis:
    """A Redis client for genfleet's counters and keys; raises BrokerUnavailable with a hint.

    `timeout_s` bounds each call (connect and reply), for callers that must not block longer
    than something they protect, such as a lease heartbeat. `client_name` names every
    connection it opens (`CLIENT SETNAME`: a worker's presence, workers/observe/liveness.py)."""
    url = settings.redis_url.get_secret_value()
    connect_s = 5.0 if timeout_s is None else min(5.0, timeout_s)
    client = redis.Redis.from_url(
        url,
        socket_connect_timeout=connect_s,
        socket_timeout=timeout_s,
        health_check_interval=30,
        client_name=client_name,
    )
    if check:
        try:
            client.ping()
        except redis.AuthenticationError as exc:
            raise BrokerUnavailable(
                f"Redis at {redact_url(url)} refused the password: check GENFLEET_REDIS_URL"
            ) from exc
        except redis.RedisError as exc:
            raise BrokerUnavailable(
                f"no Redis answers at {redact_url(url)} ({exc.__class__.__name__}). "
                "Start one (`redis-server --port 6379 --daemonize yes`) or point "
                "--redis-url / GENFLEET_REDIS_URL at yours."
            ) from exc
    return client


def text(value: object) -> str:
    """A Redis reply (bytes from a default client) as str."""
    if isinstance(value, bytes):
        return value.decode()
    return str(value)
