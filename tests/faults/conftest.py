"""Fixtures for the fault suite: services of each test's own, closed at teardown.

See harness/services.py for what each one is and how it fails.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator

import pytest

from harness.env import free_port
from harness.services import FlakyProxy, FlakyS3
from tests.fakes.http_engine import PoisonEngine


@pytest.fixture
def flaky_s3(s3_server: str) -> Iterator[FlakyS3]:
    """A fresh moto server (own port, so cutting it cannot disturb other tests) and a proxy.

    It asks for `s3_server` only for the dummy AWS credentials that fixture puts in the
    environment, which the workers inherit.
    """
    import boto3
    from moto.server import ThreadedMotoServer

    port = free_port()
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    direct = f"http://127.0.0.1:{port}"
    bucket = f"flaky-{uuid.uuid4().hex[:12]}"
    boto3.client("s3", endpoint_url=direct, region_name="us-east-1").create_bucket(Bucket=bucket)
    proxy = FlakyProxy(("127.0.0.1", port))
    yield FlakyS3(direct, proxy, bucket)
    proxy.close()
    server.stop()


@pytest.fixture
def fake_engine() -> Iterator[PoisonEngine]:
    server = PoisonEngine().start()
    yield server
    server.stop()
