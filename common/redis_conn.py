"""The Redis seam: one connection helper that maps connection failures to a clear error."""

from __future__ import annotations

import redis

from genfleet.common.errors import BrokerUnavailable
from genfleet.common.settings import Settings, redact_url


def connect(settings: Settings, check: bool = True) -> redis.Redis:
    """A Redis client for genfleet's counters and keys; raises BrokerUnavailable with a hint."""
    url = settings.redis_url.get_secret_value()
    client = redis.Redis.from_url(url, socket_connect_timeout=5, health_check_interval=30)
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
