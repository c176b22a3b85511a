"""`s3://` URLs and the boto3 client every tokenmill tool shares.

Endpoint, region and credentials come from boto3's usual chain (environment variables such as
`AWS_ENDPOINT_URL`, `AWS_PROFILE`, `~/.aws/config`, instance roles), so the same code talks to AWS
S3, MinIO or a local S3-compatible test server without flags of its own.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Any

S3_SCHEME = "s3://"


class S3Error(RuntimeError):
    """An S3 operation failed in a way the caller should report to the user."""


@dataclass(frozen=True)
class S3Url:
    bucket: str
    key: str  # an object key, or a prefix (possibly empty) for "folders"

    def __str__(self) -> str:
        return f"{S3_SCHEME}{self.bucket}/{self.key}"

    @property
    def prefix(self) -> str:
        """The key as a folder prefix: empty, or ending with exactly one '/'."""
        return self.key if not self.key or self.key.endswith("/") else self.key + "/"


def is_s3_url(value: str | object) -> bool:
    return isinstance(value, str) and value.startswith(S3_SCHEME)


def parse_s3_url(url: str) -> S3Url:
    """Split `s3://bucket/key` into bucket and key; reject anything else with a clear message."""
    if not is_s3_url(url):
        raise ValueError(f"not an s3:// URL: {url!r}")
    rest = url[len(S3_SCHEME):]
    bucket, _, key = rest.partition("/")
    if not bucket:
        raise ValueError(f"s3 URL without a bucket: {url!r}")
    # Bucket naming rules (3..63 chars, lowercase letters, digits, dots, hyphens) are enforced by
    # S3 itself; we only reject what can never be a bucket so a typo fails before any request.
    if any(c in bucket for c in " \\?#"):
        raise ValueError(f"invalid bucket name {bucket!r} in {url!r}")
    return S3Url(bucket=bucket, key=key)


_client_lock = threading.Lock()
_clients: dict[int, Any] = {}


def s3_client(max_pool_connections: int = 16):
    """A boto3 S3 client configured from the environment (one per pool size, thread-safe to use)."""
    import boto3
    from botocore.config import Config

    with _client_lock:
        # Not cached across environment changes on purpose: tests point AWS_ENDPOINT_URL at a fresh
        # server; a client is cheap next to a checkpoint download.
        session = boto3.session.Session()
        return session.client(
            "s3",
            config=Config(
                max_pool_connections=max_pool_connections,
                retries={"max_attempts": 8, "mode": "adaptive"},
                # Path-style works with every S3-compatible server; AWS accepts it too.
                s3={"addressing_style": "path"},
            ),
        )


def list_objects(client, url: S3Url) -> list[dict]:
    """Every object under a prefix: [{'Key', 'Size', 'ETag'}], folder markers excluded."""
    out: list[dict] = []
    paginator = client.get_paginator("list_objects_v2")
    for page in paginator.paginate(Bucket=url.bucket, Prefix=url.prefix):
        for obj in page.get("Contents", []):
            if obj["Key"].endswith("/"):
                continue
            out.append({"Key": obj["Key"], "Size": int(obj["Size"]), "ETag": obj["ETag"].strip('"')})
    return out


def head_object(client, url: S3Url) -> dict:
    from botocore.exceptions import ClientError

    try:
        head = client.head_object(Bucket=url.bucket, Key=url.key)
    except ClientError as exc:
        code = exc.response.get("Error", {}).get("Code", "")
        if code in ("404", "NoSuchKey", "NotFound"):
            raise FileNotFoundError(f"{url}: no such object") from exc
        raise S3Error(f"{url}: {exc}") from exc
    return {"Size": int(head["ContentLength"]), "ETag": head["ETag"].strip('"')}
