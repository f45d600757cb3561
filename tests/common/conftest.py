"""Fixtures of the common package's tests."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from tests.fakes.memory_redis import MemoryRedis


@pytest.fixture(params=["redis", "memory"])
def db(request: pytest.FixtureRequest) -> Iterator[Any]:
    """A Redis database twice: the test server's and tests/fakes' MemoryRedis, so a test that
    takes it holds on both (the fake is trusted only as far as it behaves like the server)."""
    if request.param == "memory":
        yield MemoryRedis()
    else:
        yield request.getfixturevalue("redis_client")
