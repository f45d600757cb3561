"""Buckets on a test's S3 protocol server (moto, SeaweedFS), and the credentials boto3 wants."""

from __future__ import annotations

import os
import uuid
from typing import Any

from genfleet.common.readers import ReaderOptions


def dummy_aws_credentials() -> None:
    os.environ.setdefault("AWS_ACCESS_KEY_ID", "testing")
    os.environ.setdefault("AWS_SECRET_ACCESS_KEY", "testing")
    os.environ.setdefault("AWS_DEFAULT_REGION", "us-east-1")


def new_bucket(endpoint_url: str) -> str:
    """A fresh bucket on the server; returns its store URL, `s3://BUCKET/runs`."""
    import boto3

    bucket = f"genfleet-{uuid.uuid4().hex[:12]}"
    client = boto3.client("s3", endpoint_url=endpoint_url, region_name="us-east-1")
    client.create_bucket(Bucket=bucket)
    return f"s3://{bucket}/runs"


class Bucket:
    """A fresh bucket on the S3 server at `endpoint`, written to with boto3."""

    def __init__(self, endpoint: str) -> None:
        import boto3

        self.endpoint = endpoint
        self.name = new_bucket(endpoint).removeprefix("s3://").split("/")[0]
        self.client = boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1")

    def put(self, key: str, data: bytes) -> str:
        self.client.put_object(Bucket=self.name, Key=key, Body=data)
        return f"s3://{self.name}/{key}"

    def options(self, **kwargs: Any) -> ReaderOptions:
        return ReaderOptions(s3_endpoint_url=self.endpoint, **kwargs)
