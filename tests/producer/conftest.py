"""Fixtures of the producer tests: an S3 bucket on each S3 server in turn."""

from __future__ import annotations

import pytest

from tests.support.s3 import Bucket


@pytest.fixture
def bucket(any_s3_server: str) -> Bucket:
    return Bucket(any_s3_server)
