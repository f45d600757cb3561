"""Redis in a dict: the `RedisCommands` protocol the batch path uses, and a few readers.

Replies are bytes, as from a default `redis.Redis`; keys set with `px` expire by `clock`
(monotonic seconds, the real clock unless a test passes its own), so a test can let a lease
lapse without waiting. `down = True` makes every command raise `redis.ConnectionError`, as a
client does when its server is gone. Commands run under one lock; a pipeline's run together,
as MULTI/EXEC does.
"""

from __future__ import annotations

import builtins
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import orjson
import redis

from genfleet.common.counters import COUNT_ONCE_SCRIPT
from genfleet.common.ledger import PARK_SCRIPT, RELEASE_STAGING_SCRIPT
from genfleet.common.redis_conn import RedisCommands, RedisPipeline

Value = bytes | str | int | float


def encode(value: Value) -> bytes:
    """What redis-py sends for a value: bytes as they are, text as UTF-8, numbers as text."""
    if isinstance(value, bool):
        raise redis.DataError(
            "Invalid input of type: 'bool'. Convert to a bytes, string, int or float first."
        )
    if isinstance(value, bytes):
        return value
    if isinstance(value, str):
        return value.encode()
    if isinstance(value, int):
        return str(value).encode()
    return repr(float(value)).encode()


def _bound(value: float | str) -> float:
    """A score bound as Redis reads it: a number, "-inf" or "+inf" (no exclusive bounds)."""
    return float(value.decode() if isinstance(value, bytes) else value)


WRONGTYPE = "WRONGTYPE Operation against a key holding the wrong kind of value"


class MemoryRedis:
    """One Redis database in memory (strings, hashes, sets, sorted sets; PX and PEXPIRE
    expiry; APPEND)."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self.clock = clock
        self.down = False
        self._data: dict[bytes, Any] = {}
        self._expires: dict[bytes, float] = {}
        self._lock = threading.RLock()

    def time(self) -> tuple[int, int]:
        """TIME: the server's wall clock as (seconds, microseconds), like Redis's."""
        self._check()
        now = time.time()
        return int(now), int((now % 1) * 1_000_000)

    # --- plumbing ---------------------------------------------------------------------------

    def _check(self) -> None:
        if self.down:
            raise redis.ConnectionError(
                "Error 111 connecting to 127.0.0.1:6379. Connection refused."
            )

    def _live(self, name: Value) -> bytes:
        key = encode(name)
        deadline = self._expires.get(key)
        if deadline is not None and self.clock() >= deadline:
            self._data.pop(key, None)
            self._expires.pop(key, None)
        return key

    def _get(self, name: Value, kind: type) -> Any:
        key = self._live(name)
        value = self._data.get(key)
        if value is not None and not isinstance(value, kind):
            raise redis.ResponseError(WRONGTYPE)
        return value

    def _make(self, name: Value, kind: type) -> Any:
        value = self._get(name, kind)
        if value is None:
            value = self._data[encode(name)] = kind()
        return value

    def _drop_if_empty(self, name: Value) -> None:
        key = encode(name)
        if key in self._data and not self._data[key]:
            del self._data[key]
            self._expires.pop(key, None)

    def _run(self, command: str, *args: Any, **kwargs: Any) -> Any:
        self._check()
        with self._lock:
            return getattr(self, "_" + command)(*args, **kwargs)

    # --- strings and keys -------------------------------------------------------------------

    def set(self, name: Value, value: Value, px: int | None = None, nx: bool = False) -> Any:
        return self._run("set", name, value, px, nx)

    def _set(self, name: Value, value: Value, px: int | None, nx: bool = False) -> bool | None:
        key = self._live(name)
        if nx and key in self._data:
            return None  # as redis-py answers a SET NX that did not set
        self._data[key] = _String(encode(value))
        self._expires.pop(key, None)
        if px is not None:
            if px <= 0:
                raise redis.ResponseError("invalid expire time in 'set' command")
            self._expires[key] = self.clock() + px / 1000
        return True

    def pexpire(self, name: Value, time: int) -> Any:
        return self._run("pexpire", name, time)

    def _pexpire(self, name: Value, time: int) -> bool:
        key = self._live(name)
        if key not in self._data:
            return False
        self._expires[key] = self.clock() + time / 1000
        return True

    def get(self, name: Value) -> Any:
        return self._run("get_", name)

    def _get_(self, name: Value) -> bytes | None:
        value = self._get(name, _String)
        return None if value is None else bytes(value)

    def delete(self, *names: Value) -> Any:
        return self._run("delete", *names)

    def append(self, name: Value, value: Value) -> Any:
        return self._run("append", name, value)

    def _append(self, name: Value, value: Value) -> int:
        """APPEND: the string grows (made when missing; its expiry kept); its new length."""
        key = self._live(name)
        joined = _String(bytes(self._get(name, _String) or b"") + encode(value))
        self._data[key] = joined
        return len(joined)

    def _delete(self, *names: Value) -> int:
        count = 0
        for name in names:
            key = self._live(name)
            if self._data.pop(key, None) is not None:
                count += 1
            self._expires.pop(key, None)
        return count

    def exists(self, *names: Value) -> Any:
        return self._run("exists", *names)

    def _exists(self, *names: Value) -> int:
        return sum(1 for name in names if self._live(name) in self._data)

    # --- hashes -----------------------------------------------------------------------------

    def hset(self, name: Value, key: Value, value: Value) -> Any:
        return self._run("hset", name, key, value)

    def _hset(self, name: Value, key: Value, value: Value) -> int:
        fields = self._make(name, dict)
        new = encode(key) not in fields
        fields[encode(key)] = encode(value)
        return int(new)

    def hsetnx(self, name: Value, key: Value, value: Value) -> Any:
        return self._run("hsetnx", name, key, value)

    def _hsetnx(self, name: Value, key: Value, value: Value) -> bool:
        fields = self._make(name, dict)
        if encode(key) in fields:
            return False
        fields[encode(key)] = encode(value)
        return True

    def hget(self, name: Value, key: Value) -> Any:
        return self._run("hget", name, key)

    def _hget(self, name: Value, key: Value) -> bytes | None:
        fields = self._get(name, dict) or {}
        value = fields.get(encode(key))
        return None if value is None else bytes(value)

    def hdel(self, name: Value, *keys: Value) -> Any:
        return self._run("hdel", name, *keys)

    def _hdel(self, name: Value, *keys: Value) -> int:
        fields = self._get(name, dict)
        if fields is None:
            return 0
        count = sum(1 for key in keys if fields.pop(encode(key), None) is not None)
        self._drop_if_empty(name)
        return count

    def hincrby(self, name: Value, key: Value, amount: int = 1) -> Any:
        return self._run("hincrby", name, key, amount)

    def _hincrby(self, name: Value, key: Value, amount: int) -> int:
        fields = self._make(name, dict)
        old = fields.get(encode(key), b"0")
        try:
            value = int(old) + int(amount)
        except ValueError:
            raise redis.ResponseError("hash value is not an integer") from None
        fields[encode(key)] = str(value).encode()
        return value

    def hincrbyfloat(self, name: Value, key: Value, amount: float = 1.0) -> Any:
        return self._run("hincrbyfloat", name, key, amount)

    def _hincrbyfloat(self, name: Value, key: Value, amount: float) -> float:
        fields = self._make(name, dict)
        old = fields.get(encode(key), b"0")
        try:
            value = float(old) + float(amount)
        except ValueError:
            raise redis.ResponseError("hash value is not a float") from None
        fields[encode(key)] = repr(value).encode()
        return value

    def hgetall(self, name: Value) -> Any:
        return self._run("hgetall", name)

    def _hgetall(self, name: Value) -> dict[bytes, bytes]:
        return dict(self._get(name, dict) or {})

    def hkeys(self, name: Value) -> Any:
        return self._run("hkeys", name)

    def _hkeys(self, name: Value) -> list[bytes]:
        return list(self._get(name, dict) or {})

    def hlen(self, name: Value) -> Any:
        return self._run("hlen", name)

    def _hlen(self, name: Value) -> int:
        return len(self._get(name, dict) or {})

    def hscan_iter(self, name: Value, count: int | None = None) -> Iterator[tuple[bytes, bytes]]:
        """Every field once, as SCAN promises for a hash not changed meanwhile."""
        yield from self._run("hgetall", name).items()

    # --- sets and sorted sets ---------------------------------------------------------------

    def sadd(self, name: Value, *values: Value) -> Any:
        return self._run("sadd", name, *values)

    def _sadd(self, name: Value, *values: Value) -> int:
        members = self._make(name, set)
        new = {encode(v) for v in values} - members
        members |= new
        return len(new)

    def srem(self, name: Value, *values: Value) -> Any:
        return self._run("srem", name, *values)

    def _srem(self, name: Value, *values: Value) -> int:
        members = self._get(name, set)
        if members is None:
            return 0
        gone = {encode(v) for v in values} & members
        members -= gone
        self._drop_if_empty(name)
        return len(gone)

    def smembers(self, name: Value) -> Any:
        return self._run("smembers", name)

    def _smembers(self, name: Value) -> builtins.set[bytes]:
        return set(self._get(name, set) or set())

    def sscan_iter(self, name: Value, count: int | None = None) -> Iterator[bytes]:
        """The members, from a copy taken at the call (the server's cursor may also return a
        member twice; callers take a set)."""
        yield from sorted(self._run("smembers", name))

    def scard(self, name: Value) -> Any:
        return self._run("scard", name)

    def _scard(self, name: Value) -> int:
        return len(self._get(name, set) or ())

    def zadd(self, name: Value, mapping: Mapping[Any, float]) -> Any:
        return self._run("zadd", name, mapping)

    def _zadd(self, name: Value, mapping: Mapping[Any, float]) -> int:
        scores = self._make(name, _Sorted)
        new = sum(1 for member in mapping if encode(member) not in scores)
        for member, score in mapping.items():
            scores[encode(member)] = float(score)
        return new

    def zrem(self, name: Value, *values: Value) -> Any:
        return self._run("zrem", name, *values)

    def _zrem(self, name: Value, *values: Value) -> int:
        scores = self._get(name, _Sorted)
        if scores is None:
            return 0
        removed = sum(1 for value in values if scores.pop(encode(value), None) is not None)
        self._drop_if_empty(name)
        return removed

    def zremrangebyscore(self, name: Value, min: float | str, max: float | str) -> Any:
        return self._run("zremrangebyscore", name, min, max)

    def _zremrangebyscore(self, name: Value, low: float | str, high: float | str) -> int:
        scores = self._get(name, _Sorted)
        if scores is None:
            return 0
        doomed = [m for m, s in scores.items() if _bound(low) <= s <= _bound(high)]
        for member in doomed:
            del scores[member]
        self._drop_if_empty(name)
        return len(doomed)

    def zrange(self, name: Value, start: int, end: int, withscores: bool = False) -> Any:
        return self._run("zrange", name, start, end, withscores)

    def _zrange(self, name: Value, start: int, end: int, withscores: bool) -> list[Any]:
        ordered = sorted((self._get(name, _Sorted) or {}).items(), key=lambda ms: (ms[1], ms[0]))
        stop = len(ordered) if end == -1 else end + 1
        rows = ordered[start:stop]
        return [(m, s) for m, s in rows] if withscores else [m for m, _ in rows]

    # --- pipelines --------------------------------------------------------------------------

    def pipeline(self) -> MemoryPipeline:
        return MemoryPipeline(self)

    # --- scripts ----------------------------------------------------------------------------

    def eval(self, script: str, numkeys: int, *keys_and_args: str) -> Any:
        """The ledger's scripts and the counters' count-once, each as the commands it runs,
        under the lock (atomic, as a script is on the server); any other script is refused."""
        names, args = keys_and_args[:numkeys], keys_and_args[numkeys:]
        with self._lock:
            self._check()
            if script == PARK_SCRIPT:
                if not self._exists(names[0], names[1]):
                    return 0
                self._srem(names[2], args[0])
                self._hdel(names[3], args[1])
                return 1
            if script == RELEASE_STAGING_SCRIPT:
                raw = self._hget(names[0], args[0])
                if raw is None:
                    return 0
                staging = orjson.loads(raw).get("staging")
                if staging and staging != args[1]:
                    return 0
                return self._hdel(names[0], args[0])
            if script == COUNT_ONCE_SCRIPT:
                if not self._hsetnx(names[0], args[0], args[1]):
                    return 0
                self._hincrby(names[1], args[2], int(args[1]))
                return 1
        raise redis.ResponseError("MemoryRedis runs the ledger's and counters' scripts only")

    def flushdb(self) -> bool:
        with self._lock:
            self._data.clear()
            self._expires.clear()
        return True


class _String(bytes):
    """A string value (a distinct type, so a hash command on it is a WRONGTYPE)."""


class _Sorted(dict[bytes, float]):
    """A sorted set: member → score."""


class MemoryPipeline:
    """Commands queued, then run together under the database's lock by `execute()`."""

    def __init__(self, db: MemoryRedis) -> None:
        self._db = db
        self._queued: list[tuple[str, tuple[Any, ...]]] = []

    def _queue(self, command: str, *args: Any) -> MemoryPipeline:
        self._queued.append((command, args))
        return self

    def append(self, name: Value, value: Value) -> MemoryPipeline:
        return self._queue("append", name, value)

    def delete(self, *names: Value) -> MemoryPipeline:
        return self._queue("delete", *names)

    def hset(self, name: Value, key: Value, value: Value) -> MemoryPipeline:
        return self._queue("hset", name, key, value)

    def hsetnx(self, name: Value, key: Value, value: Value) -> MemoryPipeline:
        return self._queue("hsetnx", name, key, value)

    def hdel(self, name: Value, *keys: Value) -> MemoryPipeline:
        return self._queue("hdel", name, *keys)

    def hincrby(self, name: Value, key: Value, amount: int = 1) -> MemoryPipeline:
        return self._queue("hincrby", name, key, amount)

    def hincrbyfloat(self, name: Value, key: Value, amount: float = 1.0) -> MemoryPipeline:
        return self._queue("hincrbyfloat", name, key, amount)

    def sadd(self, name: Value, *values: Value) -> MemoryPipeline:
        return self._queue("sadd", name, *values)

    def srem(self, name: Value, *values: Value) -> MemoryPipeline:
        return self._queue("srem", name, *values)

    def zadd(self, name: Value, mapping: Mapping[Any, float]) -> MemoryPipeline:
        return self._queue("zadd", name, mapping)

    def zrem(self, name: Value, *values: Value) -> MemoryPipeline:
        return self._queue("zrem", name, *values)

    def zremrangebyscore(self, name: Value, min: float | str, max: float | str) -> MemoryPipeline:
        return self._queue("zremrangebyscore", name, min, max)

    def pexpire(self, name: Value, time: int) -> MemoryPipeline:
        return self._queue("pexpire", name, time)

    def execute(self) -> list[Any]:
        """Run every queued command; like MULTI/EXEC, one that fails does not stop the others,
        and the first error is raised after all ran."""
        queued, self._queued = self._queued, []
        self._db._check()
        results: list[Any] = []
        with self._db._lock:
            for command, args in queued:
                try:
                    results.append(getattr(self._db, "_" + command)(*args))
                except redis.ResponseError as exc:
                    results.append(exc)
        for result in results:
            if isinstance(result, redis.ResponseError):
                raise result
        return results


def _is_redis_commands(db: MemoryRedis) -> RedisCommands:
    return db  # a type checker sees here that MemoryRedis is a RedisCommands


def _is_a_pipeline(pipe: MemoryPipeline) -> RedisPipeline:
    return pipe
