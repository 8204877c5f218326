"""The commit on S3: a PUT with `If-None-Match: *`, refused (412) when the key exists. A server that
ignores the header would let two writers both commit, and a refusal cannot reveal that, so the first
conditional write into a bucket puts a probe key twice; when the second is accepted it raises
S3NoConditionalWrites."""

from __future__ import annotations

import contextlib
import uuid

from slimckpt.storage.s3_client import CLIENT, Retries, call, client_error, code_of, split
from slimckpt.storage.s3_errors import no_conditional_writes
from slimckpt.storage.s3_read import read_range

PROBE_NAME = ".slimckpt-conditional-write-probe-"
CONDITIONAL_OK: set[str] = set()  # buckets whose server was seen to refuse a second conditional PUT


def put_new(path: str, data: bytes) -> bool:
    """PUT with `If-None-Match: *`: False when the key exists (412). A 409 means another conditional
    write of the key was in flight: tried once more, whose 412 (or second 409) is a False too.

    A retryable failure (throttling, a 5xx, a lost connection) is retried; the attempt it cut short may
    have landed, so a 412 after a retry is ours (True) only when the object holds exactly `data`, and a
    conflict (False) otherwise."""
    bucket, key = split(path)
    retries = Retries()
    conflicts = 0
    while True:
        try:
            CLIENT.get().put_object(Bucket=bucket, Key=key, Body=data, IfNoneMatch="*")
            return True
        except Exception as exc:  # noqa: BLE001 - a condition's answer, retried, or mapped
            code = code_of(exc) if isinstance(exc, client_error()) else ""
            if code in ("PreconditionFailed", "412"):
                return retries.attempt > 1 and holds(path, data)
            if code in ("ConditionalRequestConflict", "409"):
                conflicts += 1
                if conflicts < 2:
                    continue
                return retries.attempt > 1 and holds(path, data)
            if code in ("NotImplemented", "501"):
                raise no_conditional_writes(path) from None
            if retries.again(exc):
                continue
            err = retries.failed(exc, path)
            if err is exc:
                raise
            raise err from None


def holds(path: str, data: bytes) -> bool:
    """Whether the object at `path` is exactly `data` (a small one: a manifest, a lease)."""
    try:
        return read_range(path, 0, len(data) + 1) == data
    except FileNotFoundError:
        return False


def require_conditional_writes(path: str) -> None:
    """Raise S3NoConditionalWrites unless this bucket's server refuses a second `If-None-Match: *` PUT
    (checked once per bucket and process, with a probe key beside `path`, removed after)."""
    bucket, key = split(path)
    if bucket in CONDITIONAL_OK:
        return
    parent = key.rsplit("/", 1)[0] + "/" if "/" in key else ""
    probe = f"s3://{bucket}/{parent}{PROBE_NAME}{uuid.uuid4().hex}"
    try:
        first = put_new(probe, b"probe")
        second = put_new(probe, b"probe")
    finally:
        with contextlib.suppress(OSError):
            b, k = split(probe)
            call(probe, CLIENT.get().delete_object, Bucket=b, Key=k)
    if not first or second:
        raise no_conditional_writes(path)
    CONDITIONAL_OK.add(bucket)


__all__ = ["CONDITIONAL_OK", "PROBE_NAME", "holds", "put_new", "require_conditional_writes"]
