"""The S3 client of a process and every request sent through it: one boto3 client per process, the upload
settings (`SLIMCKPT_S3_PART_MB`, `SLIMCKPT_S3_CONCURRENCY`), an `s3://bucket/key` URL as bucket and key, and
each request retried (`SLIMCKPT_S3_RETRIES` attempts within `SLIMCKPT_S3_RETRY_S`) with its last failure
raised as the one-line error of `s3_errors`.

The endpoint, region and credentials are boto3's own chain; nothing here names them, so nothing here prints
them.
"""

# lazy imports: boto3 loads only when an s3:// path is used (importing slimckpt and `--help` stay free of it)

from __future__ import annotations

import os
import random
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

from slimckpt import env_vars
from slimckpt.storage.s3_errors import gave_up, mapped, retryable

MIB = 1 << 20
MIN_PART = 5 * MIB  # S3's smallest part (but the last)
MAX_PART = 5 << 30
BACKOFF_BASE_S = 0.2  # the first retry's wait (about); each next one doubles, up to BACKOFF_CAP_S
BACKOFF_CAP_S = 10.0


class ClientHolder:
    """One boto3 client per process (its methods are thread-safe), made at first use; a forked child
    makes its own (a client's connection pool must not cross a fork)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.client: Any = None
        self.pid = 0

    def get(self) -> Any:
        if self.client is not None and self.pid == os.getpid():
            return self.client
        with self.lock:
            if self.client is None or self.pid != os.getpid():
                self.client, self.pid = make_client(), os.getpid()
            return self.client

    def reset(self) -> None:
        self.lock = threading.Lock()
        self.client, self.pid = None, 0


def make_client() -> Any:
    import boto3
    from botocore.config import Config

    options: dict[str, Any] = {
        # one attempt per call: the retries are ours (`Retries`), bounded in attempts and time, and they
        # know when a repeated conditional PUT or completion may have landed the first time
        "retries": {"mode": "standard", "total_max_attempts": 1},
        "max_pool_connections": max(10, concurrency() + 4),
        "connect_timeout": 10,
        "read_timeout": 120,
    }
    if env_vars.foreign("AWS_ENDPOINT_URL_S3") or env_vars.foreign("AWS_ENDPOINT_URL"):
        # a compatible server on its own host name: bucket.host would not resolve
        options["s3"] = {"addressing_style": "path"}
    return boto3.session.Session().client("s3", config=Config(**options))


CLIENT = ClientHolder()


def part_bytes() -> int:
    mb = env_vars.integer("SLIMCKPT_S3_PART_MB")
    if not MIN_PART <= mb * MIB <= MAX_PART:
        raise env_vars.BadValue(
            f"SLIMCKPT_S3_PART_MB={mb}: S3 takes parts of 5 to 5120 MiB; use a value in that range (default 32)"
        )
    return mb * MIB


def concurrency() -> int:
    n = env_vars.integer("SLIMCKPT_S3_CONCURRENCY")
    if n < 1:
        raise env_vars.BadValue(f"SLIMCKPT_S3_CONCURRENCY={n}: use 1 or more parts (default 4)")
    return n


def split(url: str) -> tuple[str, str]:
    """("bucket", "key") of "s3://bucket/key" (the key without a leading "/")."""
    rest = str(url).split("://", 1)[1] if "://" in str(url) else str(url)
    bucket, _, key = rest.partition("/")
    if not bucket:
        raise ValueError(f"{url}: no bucket in this URL; write s3://<bucket>/<key>")
    return bucket, key.lstrip("/")


def dir_prefix(key: str) -> str:
    """The key prefix of the objects under a "directory" ("" for the bucket's root)."""
    key = key.rstrip("/")
    return f"{key}/" if key else ""


def under(url: str, prefix: str) -> bool:
    """Whether `url` is `prefix` or a key under it."""
    p = prefix.rstrip("/")
    return url == p or url.startswith(p + "/")


class Retries:
    """The retries of one request: at most `SLIMCKPT_S3_RETRIES` attempts within `SLIMCKPT_S3_RETRY_S`
    seconds, waiting between them with exponential backoff and jitter (about 0.2, 0.4, 0.8 ... s, at most
    10 s, each a random 50-100% of that). Only a retryable failure is tried again (`s3_errors.retryable`)."""

    def __init__(self, most: int | None = None) -> None:
        self.attempts = env_vars.integer("SLIMCKPT_S3_RETRIES")
        if self.attempts < 1:
            raise env_vars.BadValue(f"SLIMCKPT_S3_RETRIES={self.attempts}: use 1 or more attempts (default 10)")
        if most is not None:
            self.attempts = min(self.attempts, most)
        self.budget = env_vars.seconds("SLIMCKPT_S3_RETRY_S")
        self.start = time.monotonic()
        self.attempt = 1

    def again(self, exc: BaseException) -> bool:
        """Whether to send the request once more after `exc` (having waited); False: give up now."""
        if not retryable(exc) or self.attempt >= self.attempts:
            return False
        ceiling = min(BACKOFF_CAP_S, BACKOFF_BASE_S * 2 ** (self.attempt - 1))
        wait = ceiling * random.uniform(0.5, 1.0)
        if time.monotonic() - self.start + wait > self.budget:
            return False
        time.sleep(wait)
        self.attempt += 1
        return True

    def failed(self, exc: BaseException, url: str, *, bucket_level: bool = False) -> BaseException:
        """The one-line error for the last failure (saying how often it was tried when it was more than once)."""
        err = mapped(exc, url, bucket_level=bucket_level)
        if self.attempt > 1:
            err = gave_up(err, self.attempt, time.monotonic() - self.start)
        return err


def retried(url: str, attempt: Callable[[], Any], *, bucket_level: bool = False, most: int | None = None) -> Any:
    """`attempt()` until it returns, retried by `Retries` (at most `most` attempts when given); its last
    botocore failure raised as the one-line error about `url` (anything else as it is)."""
    retries = Retries(most)
    while True:
        try:
            return attempt()
        except Exception as exc:  # noqa: BLE001 - mapped to S3Error when it is botocore's, else re-raised as it is
            if retries.again(exc):
                continue
            err = retries.failed(exc, url, bucket_level=bucket_level)
            if err is exc:
                raise
            raise err from None


def call(
    url: str, fn: Callable[..., Any], *, bucket_level: bool = False, most: int | None = None, **kwargs: Any
) -> Any:
    """`fn(**kwargs)`, retried, with its botocore failure raised as the one-line error about `url`."""
    body = kwargs.get("Body")

    def attempt() -> Any:
        if hasattr(body, "seek"):
            body.seek(0)  # a retry sends the whole body again
        return fn(**kwargs)

    return retried(url, attempt, bucket_level=bucket_level, most=most)


def listing(url: str, *, bucket_level: bool = True, **kwargs: Any) -> Iterator[dict]:
    """The pages of ListObjectsV2 (`kwargs`: Bucket, Prefix, Delimiter), each request retried."""
    token: dict[str, str] = {}
    while True:
        page = call(url, CLIENT.get().list_objects_v2, bucket_level=bucket_level, **kwargs, **token)
        yield page
        if not page.get("IsTruncated") or not page.get("NextContinuationToken"):
            return
        token = {"ContinuationToken": page["NextContinuationToken"]}


def code_of(exc: BaseException) -> str:
    response = getattr(exc, "response", None) or {}
    code = str(response.get("Error", {}).get("Code", ""))
    status = response.get("ResponseMetadata", {}).get("HTTPStatusCode")
    return code or str(status or "")


def client_error() -> type[Exception]:
    from botocore.exceptions import ClientError

    return ClientError


__all__ = [
    "CLIENT",
    "MAX_PART",
    "MIB",
    "MIN_PART",
    "ClientHolder",
    "Retries",
    "call",
    "client_error",
    "code_of",
    "concurrency",
    "dir_prefix",
    "listing",
    "make_client",
    "part_bytes",
    "retried",
    "split",
    "under",
]
