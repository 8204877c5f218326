"""`Storage` on S3 and S3-compatible object stores (AWS S3, SeaweedFS, MinIO, Ceph, R2...), through boto3.

A path is `s3://bucket/key`; a "directory" is a key prefix (`key/`), which needs no object of its own.
The endpoint, region and credentials are boto3's own chain (AWS_ENDPOINT_URL, AWS_REGION, AWS_PROFILE,
AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY, ~/.aws/config); nothing here names them, so nothing here prints
them. With AWS_ENDPOINT_URL set, keys are addressed path-style (`host/bucket/key`), which every
compatible server takes.

What S3 gives: a PUT, or the completion of a multipart upload, is atomic and durable when it returns
(a reader sees the whole new object or none), and `If-None-Match: *` makes a PUT fail (412) when the key
exists. What it does not: no rename (of an object or a prefix), no write at an offset of an existing
object, no lock that dies with its holder. So each of `Storage`'s choices is made this way:

ranges    `supports_inplace_writes = False`. create_ranges/open_ranges take one writer per file, its
          bytes in order from offset 0 with no gap (open_ranges in the same process continues the upload
          create_ranges began); they become parts of one multipart upload, completed when the file's
          last byte arrives. A write out of order is refused (ValueError naming the path).
stream    open_stream: parts of `SLIMCKPT_S3_PART_MB` uploaded by a thread pool as they fill; a file
          smaller than a part is one PUT at the end. The upload completes when the block ends without an
          error and is aborted when it raises: nothing is visible at the key before it completes.
          Memory: a writing process holds at most `SLIMCKPT_S3_CONCURRENCY` parts (the one being filled,
          the rest uploading; a writer waits while they are all in flight), plus one part being filled
          per further stream it has open at the same time.
atomic    open_atomic/put_atomic: the small file in memory, one PUT (already atomic: no temporary key).
commit    put_if_absent: a PUT with `If-None-Match: *`. A server that ignores the header would let two
          writers both commit, and a refusal cannot reveal that, so the first conditional write into a
          bucket puts a probe key twice; when the second is accepted it raises S3NoConditionalWrites.
sync      sync, sync_tree, sync_open, make_dirs: nothing to do (durable on return; prefixes need no object).
publish   `supports_dir_rename = False`: an output is written in its final place and committed by its
          manifest alone; atomic_publish raises. replace is a server-side copy then a delete (up to 5 GiB).
leases    `supports_leases_that_die_with_holder = False`. Exclusive: a small JSON object put with
          `If-None-Match: *` (holder, expiry `SLIMCKPT_S3_LEASE_S` ahead), renewed by its holder every
          quarter of that; a writer finding one held watches it until it expires: renewed, it is busy;
          expired unrenewed (its holder was killed), it is taken over.
          Shared: granted without an object: a reader of a committed step is protected by the commit
          rules instead (pruning deletes the manifest before any file, so a reader never takes a step
          being deleted as committed).
room      free_bytes is a very large number (a bucket does not fill up); used_bytes sums object sizes.
reads     open_read: a seekable reader doing ranged GETs of 8 MiB blocks (it holds one block).

Every failure is raised as the one-line errors of `s3_errors` (the URL and the fix); `check_access`
makes one cheap request first so that a tool refuses before writing anything.

This module is the backend; its parts: `s3_client` (the client, URLs, every request retried),
`s3_upload` (stream: an object written in order in bounded memory), `s3_ranges` (ranges), `s3_read`
(reads), `s3_conditional` (commit), `s3_leases` (leases), `s3_errors` (the one-line errors).
"""

from __future__ import annotations

import contextlib
import errno
import io
import os
from collections.abc import Iterator
from typing import IO, Any

from slimckpt.storage import s3_leases, s3_ranges
from slimckpt.storage.base import Storage
from slimckpt.storage.s3_client import CLIENT, call, dir_prefix, listing, split
from slimckpt.storage.s3_conditional import CONDITIONAL_OK, put_new, require_conditional_writes
from slimckpt.storage.s3_errors import S3Error, S3Failed, S3NotFound
from slimckpt.storage.s3_leases import S3Lease
from slimckpt.storage.s3_ranges import S3RangeWriter
from slimckpt.storage.s3_read import S3Reader, read_range
from slimckpt.storage.s3_upload import BUDGET, StreamFile, Upload, abort_unfinished

MAX_COPY = 5 << 30  # one CopyObject; above it a multipart copy would be needed
DELETE_BATCH = 1000  # DeleteObjects' limit
CHECK_ATTEMPTS = 3  # the start-up check's requests: a wrong endpoint or a stopped server is said at once
# a bucket does not fill up: the room check passes whatever the output's size
UNLIMITED = 1 << 62


def after_fork() -> None:
    """This process's client, upload budget, unfinished ranged files and checked buckets start over (a
    forked child, or a test with another environment)."""
    CLIENT.reset()
    BUDGET.reset()
    s3_ranges.OPEN_RANGES.clear()
    CONDITIONAL_OK.clear()


os.register_at_fork(after_in_child=after_fork)


class S3Storage(Storage):
    supports_inplace_writes = False
    supports_dir_rename = False
    supports_leases_that_die_with_holder = False
    is_local = False

    @staticmethod
    def client() -> Any:
        return CLIENT.get()

    def check_access(self, url: str) -> None:
        """One cheap request, before anything is written: the bucket is there, and its keys under the
        URL's prefix may be listed with these credentials (else the one-line S3Error with its fix). Tried
        CHECK_ATTEMPTS times at most: a wrong endpoint is said in seconds, not after a save's retries."""
        bucket, key = split(url)
        client = CLIENT.get()
        try:
            call(url, client.head_bucket, bucket_level=True, most=CHECK_ATTEMPTS, Bucket=bucket)
        except S3Error as head_failed:
            # a HEAD's answer has no body, so no error code: a 403 may be a wrong secret, a 301 any
            # region; the listing's answer names it
            try:
                call(
                    url,
                    client.list_objects_v2,
                    bucket_level=True,
                    most=CHECK_ATTEMPTS,
                    Bucket=bucket,
                    Prefix=key,
                    MaxKeys=1,
                )
            except S3Error as named:
                raise named from None
            raise head_failed from None
        call(url, client.list_objects_v2, bucket_level=True, most=CHECK_ATTEMPTS, Bucket=bucket, Prefix=key, MaxKeys=1)

    # ------------------------------------------------------------------ room

    def free_bytes(self, path: str) -> int:
        return UNLIMITED

    def used_bytes(self, path: str) -> int:
        return sum(size for _key, size in self.objects(path))

    # ------------------------------------------------------------------ leases

    def lease(self, key: str, *, exclusive: bool) -> S3Lease | None:
        return s3_leases.take(self, key, exclusive=exclusive)

    def lease_note(self, key: str) -> str:
        return s3_leases.lease_note(key)

    # ------------------------------------------------------------------ directories

    def make_dirs(self, path: str, *, exist_ok: bool = False) -> None:
        pass  # a prefix exists as soon as a key under it does

    # ------------------------------------------------------------------ writes

    def create_ranges(
        self, path: str, size: int, *, sparse: bool = False
    ) -> S3RangeWriter:  # sparse: an upload reserves nothing anyway
        return s3_ranges.create(path, size)

    def open_ranges(self, path: str) -> S3RangeWriter:
        return s3_ranges.reopen(path)

    @contextlib.contextmanager
    def open_atomic(
        self, path: str, *, tmp: str | None = None, sync: bool = True, sync_dir: bool = True
    ) -> Iterator[IO[bytes]]:
        # a PUT replaces the whole object in one step and is durable on return: no tmp key, no sync
        bucket, key = split(path)
        buf = io.BytesIO()
        yield buf
        call(path, CLIENT.get().put_object, Bucket=bucket, Key=key, Body=buf.getvalue())

    def put_atomic(
        self, path: str, data: bytes, *, tmp: str | None = None, sync: bool = True, sync_dir: bool = True
    ) -> None:
        bucket, key = split(path)
        call(path, CLIENT.get().put_object, Bucket=bucket, Key=key, Body=bytes(data))

    def put_if_absent(self, path: str, data: bytes, *, tmp: str | None = None) -> bool:
        require_conditional_writes(path)
        return put_new(path, bytes(data))

    @contextlib.contextmanager
    def open_stream(self, path: str) -> Iterator[IO[bytes]]:
        upload = Upload(path)
        try:
            yield StreamFile(upload)  # type: ignore[misc]
        except BaseException:
            upload.abort()
            raise
        upload.finish()

    def abort_uploads(self, prefix: str) -> int:
        return s3_ranges.drop_under(prefix) + abort_unfinished(prefix)

    def sync_open(self, f: int | IO) -> None:
        pass  # what an S3 file object wrote is durable when its upload completes

    # ------------------------------------------------------------------ durability

    def sync(self, path: str) -> None:
        pass  # a PUT (or a completed multipart upload) is durable when it returns

    def sync_tree(self, root: str) -> None:
        pass  # as sync

    # ------------------------------------------------------------------ publish

    def atomic_publish(self, partial: str, final: str, *, aside: str | None = None, durable: bool = True) -> None:
        raise NotImplementedError(
            f"{partial}: S3 has no rename of a prefix; write the output at {final} and commit it with "
            f"put_if_absent of its manifest (check supports_dir_rename)"
        )

    def replace(self, src: str, dst: str) -> None:
        sb, sk = split(src)
        db, dk = split(dst)
        size = self.size(src)
        if size > MAX_COPY:
            raise S3Failed(
                errno.EFBIG, f"{size} bytes, above the 5 GiB one S3 copy takes; write it at {dst} directly", src
            )
        call(dst, CLIENT.get().copy_object, Bucket=db, Key=dk, CopySource={"Bucket": sb, "Key": sk})
        call(src, CLIENT.get().delete_object, Bucket=sb, Key=sk)

    # ------------------------------------------------------------------ deletes

    def remove(self, path: str) -> None:
        bucket, key = split(path)
        call(path, CLIENT.get().head_object, Bucket=bucket, Key=key)  # FileNotFoundError when absent
        call(path, CLIENT.get().delete_object, Bucket=bucket, Key=key)

    def remove_tree(self, path: str, *, ignore_errors: bool = False) -> list[str]:
        bucket, key = split(path)
        s3_ranges.drop_under(path)
        keys = [k for k, _size in self.objects(path)]
        if key and self.is_file(path):
            keys.append(key)  # an object named exactly like the prefix
        if not keys:
            if not ignore_errors:
                raise S3NotFound(
                    errno.ENOENT, "no object under this prefix; check the URL (is the step committed?)", path
                )
            return [f"{path}: no object under this prefix"]
        errors: list[str] = []
        client = CLIENT.get()
        for i in range(0, len(keys), DELETE_BATCH):
            batch = [{"Key": k} for k in keys[i : i + DELETE_BATCH]]
            out = call(path, client.delete_objects, Bucket=bucket, Delete={"Objects": batch, "Quiet": True})
            for e in out.get("Errors", []):
                errors.append(f"s3://{bucket}/{e.get('Key')}: {e.get('Code')} {e.get('Message', '')}".strip())
        if errors and not ignore_errors:
            raise S3Failed(
                errno.EIO,
                f"{len(errors)} objects not deleted, the first: {errors[0]}; "
                f"retry, or delete them with the store's own tools",
                path,
            )
        return errors

    # ------------------------------------------------------------------ reads

    def objects(self, path: str) -> Iterator[tuple[str, int]]:
        """(key, size) of every object under the prefix `path/`."""
        bucket, key = split(path)
        for page in listing(path, Bucket=bucket, Prefix=dir_prefix(key)):
            for obj in page.get("Contents", []):
                yield obj["Key"], int(obj.get("Size", 0))

    def is_file(self, path: str) -> bool:
        bucket, key = split(path)
        if not key:
            return False
        try:
            call(path, CLIENT.get().head_object, Bucket=bucket, Key=key)
        except FileNotFoundError:
            return False
        return True

    def exists(self, path: str) -> bool:
        return self.is_file(path) or self.is_dir(path)

    def is_dir(self, path: str) -> bool:
        bucket, key = split(path)
        out = call(
            path, CLIENT.get().list_objects_v2, bucket_level=True, Bucket=bucket, Prefix=dir_prefix(key), MaxKeys=1
        )
        return bool(out.get("KeyCount") or out.get("Contents"))

    def size(self, path: str) -> int:
        bucket, key = split(path)
        return int(call(path, CLIENT.get().head_object, Bucket=bucket, Key=key)["ContentLength"])

    def list_dir(self, path: str) -> list[str]:
        bucket, key = split(path)
        prefix = dir_prefix(key)
        names: set[str] = set()
        for page in listing(path, Bucket=bucket, Prefix=prefix, Delimiter="/"):
            for obj in page.get("Contents", []):
                name = obj["Key"][len(prefix) :]
                if name:  # "prefix/" itself: a folder marker some tools put
                    names.add(name)
            for common in page.get("CommonPrefixes", []):
                name = common["Prefix"][len(prefix) :].rstrip("/")
                if name:
                    names.add(name)
        if not names:
            raise S3NotFound(errno.ENOENT, "no object under this prefix; check the URL (is the step committed?)", path)
        return sorted(names)

    def open_read(self, path: str) -> contextlib.AbstractContextManager[IO[bytes]]:
        return S3Reader(path, self.size(path))  # type: ignore[return-value]

    def list_files(self, root: str) -> list[str]:
        _bucket, key = split(root)
        prefix = dir_prefix(key)
        return sorted(k[len(prefix) :] for k, _size in self.objects(root) if not k.endswith("/"))

    def read_range(self, path: str, offset: int, length: int) -> bytes:
        return read_range(path, offset, length)


__all__ = ["S3Storage", "after_fork"]
