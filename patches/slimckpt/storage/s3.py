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
"""

# lazy imports: boto3 loads only when an s3:// path is used (importing slimckpt and `--help` stay free of it)

from __future__ import annotations

import contextlib
import errno
import hashlib
import io
import json
import os
import random
import socket
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from typing import IO, Any

from slimckpt import env_vars
from slimckpt.storage.base import Lease, RangeWriter, Storage
from slimckpt.storage.s3_errors import S3Error, S3Failed, S3NotFound, gave_up, mapped, no_conditional_writes, retryable

MIB = 1 << 20
MIN_PART = 5 * MIB  # S3's smallest part (but the last)
MAX_PART = 5 << 30
MAX_PARTS = 10_000
MAX_COPY = 5 << 30  # one CopyObject; above it a multipart copy would be needed
READ_BLOCK = 8 * MIB
DELETE_BATCH = 1000  # DeleteObjects' limit
BACKOFF_BASE_S = 0.2  # the first retry's wait (about); each next one doubles, up to BACKOFF_CAP_S
BACKOFF_CAP_S = 10.0
CHECK_ATTEMPTS = 3  # the start-up check's requests: a wrong endpoint or a stopped server is said at once
# a bucket does not fill up: the room check passes whatever the output's size
UNLIMITED = 1 << 62
PROBE_NAME = ".slimckpt-conditional-write-probe-"


# ---------------------------------------------------------------------- the client, one per process


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


class Budget:
    """The parts a process may have uploading at once, and the threads that upload them. With one
    part being filled beside them, a writer holds `concurrency` parts at most."""

    def __init__(self, part: int, parts: int) -> None:
        self.part, self.parts = part, parts
        self.in_flight = max(1, parts - 1)
        self.slots = threading.BoundedSemaphore(self.in_flight)
        self.pool = ThreadPoolExecutor(max_workers=self.in_flight, thread_name_prefix="slimckpt-s3")
        # part buffers reused while uploads run: a fresh part-sized buffer per part leaves the allocator
        # holding freed ones (glibc raises its mmap threshold after the first free), above the bound
        self.lock = threading.Lock()
        self.free: list[bytearray] = []
        self.users = 0

    def take(self) -> bytearray:
        with self.lock:
            return self.free.pop() if self.free else bytearray(self.part)

    def give(self, buf: bytearray | None) -> None:
        if buf is None:
            return
        with self.lock:
            if self.users and len(self.free) < self.parts:
                self.free.append(buf)

    def begin(self) -> None:
        with self.lock:
            self.users += 1

    def end(self) -> None:
        """An upload is over; the last one out drops the spare buffers (nothing held between saves)."""
        with self.lock:
            self.users = max(0, self.users - 1)
            if not self.users:
                self.free.clear()


class BudgetHolder:
    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.budget: Budget | None = None

    def get(self) -> Budget:
        part, parts = part_bytes(), concurrency()
        with self.lock:
            b = self.budget
            if b is None or (b.part, b.parts) != (part, parts):
                # changed settings: a new budget (uploads still running on the old one finish there)
                b = self.budget = Budget(part, parts)
            return b

    def reset(self) -> None:
        self.lock = threading.Lock()
        self.budget = None


BUDGET = BudgetHolder()


def after_fork() -> None:
    CLIENT.reset()
    BUDGET.reset()
    OPEN_RANGES.clear()
    CONDITIONAL_OK.clear()


os.register_at_fork(after_in_child=after_fork)


# ---------------------------------------------------------------------- URLs


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


# ---------------------------------------------------------------------- uploads


class Positioned(io.RawIOBase):
    """A readable, seekable raw file of `length` bytes at position `pos` (a part's body, an object's reader)."""

    length = 0
    pos = 0
    name = ""

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self.pos

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self.pos, io.SEEK_END: self.length}[whence]
        if base + offset < 0:
            raise ValueError(f"{self.name}: negative seek position {base + offset}")
        self.pos = base + offset
        return self.pos


class PartBody(Positioned):
    """A filled part handed to the client as a seekable file, without a copy of its buffer."""

    def __init__(self, buf: bytearray, n: int) -> None:
        super().__init__()
        self.view = memoryview(buf)[:n]
        self.length, self.pos = n, 0

    def __len__(self) -> int:
        return len(self.view)

    def read(self, size: int = -1) -> memoryview:  # type: ignore[override]
        # a view, not a copy: the client hashes and sends the part in pieces, and a fresh bytes object
        # per piece leaves freed memory with the allocator (the upload's bound is the part buffers)
        end = len(self.view) if size is None or size < 0 else min(len(self.view), self.pos + size)
        out = self.view[self.pos : end]
        self.pos = max(self.pos, end)
        return out

    def readinto(self, b: Any) -> int:
        n = min(len(b), len(self.view) - self.pos)
        b[:n] = self.view[self.pos : self.pos + n]
        self.pos += n
        return n


class Upload:
    """One object written in order: bytes gathered into parts, parts uploaded as they fill (a multipart
    upload begun at the first full part), completed by `finish`, dropped by `abort`."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.bucket, self.key = split(url)
        self.budget = BUDGET.get()
        self.budget.begin()
        self.part = self.budget.part
        self.buf: bytearray | None = None
        self.fill = 0
        self.written = 0
        self.upload_id: str | None = None
        self.parts: list[tuple[int, Future]] = []
        self.state = "open"  # open -> done | aborted
        self.lock = threading.RLock()  # a range writer and its reopened twin may share it

    # -- writing

    def write(self, data: Any) -> int:
        view = memoryview(data)
        if view.ndim != 1 or view.itemsize != 1:
            view = view.cast("B")
        with self.lock:
            if self.state != "open":
                raise ValueError(f"{self.url}: write to an upload already {self.state}")
            self.raise_failed_part()
            done, total = 0, len(view)
            while done < total:
                if self.buf is None:
                    self.buf, self.fill = self.budget.take(), 0
                take = min(total - done, self.part - self.fill)
                self.buf[self.fill : self.fill + take] = view[done : done + take]
                self.fill += take
                done += take
                if self.fill == self.part:
                    self.ship()
            self.written += total
            return total

    def ship(self) -> None:
        """The filled buffer to the upload threads (waiting while the process's parts are all in flight)."""
        buf, n = self.buf, self.fill
        self.buf, self.fill = None, 0
        if self.upload_id is None:
            out = call(self.url, CLIENT.get().create_multipart_upload, Bucket=self.bucket, Key=self.key)
            self.upload_id = out["UploadId"]
        number = len(self.parts) + 1
        if number > MAX_PARTS:
            raise ValueError(
                f"{self.url}: more than {MAX_PARTS} parts of {self.part // MIB} MiB (S3's limit per object); "
                f"raise SLIMCKPT_S3_PART_MB"
            )
        budget = self.budget
        budget.slots.acquire()
        try:
            future = budget.pool.submit(self.put_part, number, buf, n)
        except BaseException:
            budget.slots.release()
            raise

        def done(_f: Future) -> None:
            budget.give(buf)  # the part is sent (or failed): its buffer fills another
            budget.slots.release()

        future.add_done_callback(done)
        self.parts.append((number, future))

    def put_part(self, number: int, buf: bytearray, n: int) -> str:
        out = call(
            self.url,
            CLIENT.get().upload_part,
            Bucket=self.bucket,
            Key=self.key,
            UploadId=self.upload_id,
            PartNumber=number,
            Body=PartBody(buf, n),
        )
        return out["ETag"]

    def raise_failed_part(self) -> None:
        for _number, future in self.parts:
            if future.done() and future.exception() is not None:
                raise future.exception()  # type: ignore[misc]

    # -- the end

    def finish(self) -> None:
        """Every byte written, visible at the key (durable) when this returns."""
        with self.lock:
            if self.state == "done":
                return
            if self.state != "open":
                raise ValueError(f"{self.url}: upload already {self.state}")
            try:
                if self.upload_id is None:
                    body = PartBody(self.buf, self.fill) if self.buf is not None else b""
                    call(self.url, CLIENT.get().put_object, Bucket=self.bucket, Key=self.key, Body=body)
                else:
                    if self.fill:
                        self.ship()
                    self.complete([(number, future.result()) for number, future in self.parts])
            except BaseException:
                self.abort()
                raise
            self.budget.give(self.buf)
            self.state, self.buf, self.parts = "done", None, []
            self.budget.end()

    def complete(self, etags: list[tuple[int, str]]) -> None:
        """CompleteMultipartUpload, retried. A retry answered NoSuchUpload may follow a first attempt that
        completed with its answer lost: it is done when the key's ETag is the one these parts make."""
        client = CLIENT.get()
        retries = Retries()
        parts = {"Parts": [{"ETag": etag, "PartNumber": n} for n, etag in etags]}
        while True:
            try:
                client.complete_multipart_upload(
                    Bucket=self.bucket, Key=self.key, UploadId=self.upload_id, MultipartUpload=parts
                )
                return
            except Exception as exc:  # noqa: BLE001 - retried or mapped
                if retries.attempt > 1 and code_of(exc) in ("NoSuchUpload", "404") and self.completed_as(etags):
                    return
                if retries.again(exc):
                    continue
                err = retries.failed(exc, self.url)
                if err is exc:
                    raise
                raise err from None

    def completed_as(self, etags: list[tuple[int, str]]) -> bool:
        try:
            head = CLIENT.get().head_object(Bucket=self.bucket, Key=self.key)
        except Exception:  # noqa: BLE001 - no object (or no answer): not completed as far as we can tell
            return False
        return str(head.get("ETag", "")).strip('"') == multipart_etag([etag for _n, etag in etags])

    def abort(self) -> None:
        """Nothing of this write left at the key, nor as an unfinished upload (idempotent)."""
        with self.lock:
            if self.state != "open":
                return
            self.budget.give(self.buf)
            self.state, self.buf = "aborted", None
            self.budget.end()
            for _number, future in self.parts:
                future.cancel()
            for _number, future in self.parts:
                with contextlib.suppress(BaseException):
                    future.exception()  # waits: a part still uploading must end before the abort
            self.parts = []
            if self.upload_id is not None:
                with contextlib.suppress(S3Error):
                    call(
                        self.url,
                        CLIENT.get().abort_multipart_upload,
                        Bucket=self.bucket,
                        Key=self.key,
                        UploadId=self.upload_id,
                    )


def multipart_etag(etags: list[str]) -> str:
    """The ETag S3 gives an object completed from parts with these ETags: the MD5 of their MD5s, "-" count
    ("" when a part's ETag is not a plain MD5, e.g. under SSE-KMS: then no match is claimed)."""
    try:
        digests = b"".join(bytes.fromhex(e.strip('"')) for e in etags)
    except ValueError:
        return ""
    return f"{hashlib.md5(digests, usedforsecurity=False).hexdigest()}-{len(etags)}"


class StreamFile:
    """The write-only file `open_stream` yields: write, tell, flush (nothing to flush: parts leave as
    they fill); no seek. close() completes the object, as the end of the `with` block does."""

    def __init__(self, upload: Upload) -> None:
        self.upload = upload
        self.name = upload.url

    def write(self, data: Any) -> int:
        return self.upload.write(data)

    def tell(self) -> int:
        return self.upload.written

    def writable(self) -> bool:
        return True

    def readable(self) -> bool:
        return False

    def seekable(self) -> bool:
        return False

    def flush(self) -> None:
        pass

    @property
    def closed(self) -> bool:
        return self.upload.state != "open"

    def close(self) -> None:
        if self.upload.state == "open":
            self.upload.finish()

    def __enter__(self) -> StreamFile:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class S3RangeWriter(RangeWriter):
    """Ranged writes of one file, for a single writer putting its bytes in order from 0 (S3 cannot
    write into an object): each write continues the upload; the file's last byte completes it."""

    def __init__(self, upload: Upload, size: int) -> None:
        self.path, self.upload, self.size = upload.url, upload, size
        self.closed = False
        if size == 0:
            self.finish()

    def write(self, data: memoryview | bytes, offset: int) -> None:
        n = memoryview(data).nbytes
        with self.upload.lock:
            at = self.upload.written
            if offset != at or at + n > self.size:
                raise ValueError(
                    f"{self.path}: write of {n} bytes at offset {offset}, but S3 takes a file's bytes in order "
                    f"({at} of {self.size} written so far): one writer per file, ranges in increasing order"
                )
            self.upload.write(data)
            if self.upload.written == self.size:
                self.finish()

    def finish(self) -> None:
        self.upload.finish()
        OPEN_RANGES.pop(self.path, None)

    def sync(self) -> None:
        if self.upload.state != "done":
            raise ValueError(
                f"{self.path}: {self.upload.written} of {self.size} bytes written: an S3 object exists only "
                f"once all of it is (its writer must write every range, in order)"
            )

    def close(self) -> None:
        # an unfinished file stays open in this process: open_ranges continues it (a header written
        # by a coordinator, then the rest), abort_uploads or remove_tree drops it
        self.closed = True


OPEN_RANGES: dict[str, S3RangeWriter] = {}  # files being written by ranges in this process, by URL
CONDITIONAL_OK: set[str] = set()  # buckets whose server was seen to refuse a second conditional PUT


class S3Lease(Lease):
    """A lease held on S3. An exclusive one is renewed by a thread every quarter of
    `SLIMCKPT_S3_LEASE_S` while it is held, so it expires that long after its holder dies (a SIGKILL, a
    lost node) and the next writer takes it over then, instead of being refused until a long expiry."""

    def __init__(self, store: S3Storage, key: str, exclusive: bool, token: str | None, body: dict) -> None:
        self.store, self.key, self.exclusive = store, key, exclusive
        self.token, self.body = token, body
        self.held = True
        self.lock = threading.Lock()
        self.stopped = threading.Event()
        if exclusive:
            threading.Thread(target=self.renew_until_released, name="slimckpt-s3-lease", daemon=True).start()

    def put_body(self, **changes: Any) -> None:
        """Our lease object again with `changes` and a new expiry, unless it is no longer ours."""
        with self.lock:
            if not self.held:
                return
            body = dict(self.body, **changes, expires=time.time() + env_vars.seconds("SLIMCKPT_S3_LEASE_S"))
            bucket, key = split(self.key)
            with contextlib.suppress(S3Error):
                # checked first: an expired lease may have been taken over (a holder stalled past its expiry)
                if (self.store.lease_body(self.key) or {}).get("token") != self.token:
                    return
                call(self.key, CLIENT.get().put_object, Bucket=bucket, Key=key, Body=json.dumps(body).encode())
                self.body = body

    def renew_until_released(self) -> None:
        while not self.stopped.wait(max(0.05, env_vars.seconds("SLIMCKPT_S3_LEASE_S") / 4)):
            self.put_body()

    def note(self, text: str) -> None:
        if self.held and self.exclusive:
            self.put_body(note=text)

    def release(self) -> None:
        if not self.held:
            return
        self.stopped.set()
        with self.lock:
            self.held = False
        if not self.exclusive:
            return
        # only our own: an expired lease may have been taken over by another writer since; a release that
        # fails (the server gone, the credentials revoked) leaves the lease to expire
        with contextlib.suppress(S3Error):
            if (self.store.lease_body(self.key) or {}).get("token") == self.token:
                with contextlib.suppress(FileNotFoundError):
                    self.store.remove(self.key)


class S3Reader(Positioned):
    """A read-only, seekable view of one object: ranged GETs of a block at a time (one block held)."""

    def __init__(self, url: str, size: int, block: int = READ_BLOCK) -> None:
        super().__init__()
        self.url, self.length, self.block_size = url, size, block
        self.bucket, self.key = split(url)
        self.name = url
        self.pos = 0
        self.block = b""
        self.block_at = 0

    def get(self, offset: int, n: int) -> bytes:
        def attempt() -> bytes:
            out = CLIENT.get().get_object(Bucket=self.bucket, Key=self.key, Range=f"bytes={offset}-{offset + n - 1}")
            return out["Body"].read()  # a connection lost while the body streams is retried too

        return retried(self.url, attempt)

    def readinto(self, b: Any) -> int:
        view = memoryview(b).cast("B")
        want = min(len(view), max(0, self.length - self.pos))
        done = 0
        while done < want:
            at = self.pos + done
            inside = at - self.block_at
            if not (0 <= inside < len(self.block)):
                if want - done >= self.block_size:  # a large read goes straight to the caller's buffer
                    data = self.get(at, self.block_size)
                    if not data:
                        break
                    view[done : done + len(data)] = data
                    done += len(data)
                    continue
                self.block, self.block_at = b"", at
                self.block = self.get(at, min(self.block_size, self.length - at))
                if not self.block:
                    break
                inside = 0
            take = min(want - done, len(self.block) - inside)
            view[done : done + take] = self.block[inside : inside + take]
            done += take
        self.pos += done
        return done

    def readall(self) -> bytes:
        out = bytearray(max(0, self.length - self.pos))
        n = self.readinto(out)
        return bytes(out[:n])

    def close(self) -> None:
        self.block = b""
        super().close()


# ---------------------------------------------------------------------- the backend


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
        if not exclusive:
            return S3Lease(self, key, False, None, {})
        bucket, k = split(key)
        self.require_conditional_writes(key)
        for _ in range(3):
            now = time.time()
            token = uuid.uuid4().hex
            body = {
                "holder": f"pid {os.getpid()} on {socket.gethostname()}",
                "created": now,
                "expires": now + env_vars.seconds("SLIMCKPT_S3_LEASE_S"),
                "token": token,
            }
            if self.put_new(key, json.dumps(body).encode()):
                return S3Lease(self, key, True, token, body)
            held = self.lease_body(key)
            if held is None:
                continue  # released between our put and our read: try again
            expires = held.get("expires")
            if not isinstance(expires, int | float):
                return None  # not one of ours: held, no expiry known
            if expires >= time.time() and not self.expired_unrenewed(key, expires):
                return None  # its holder renews it (alive), or it outlasts our watch
            with contextlib.suppress(FileNotFoundError):
                call(key, CLIENT.get().delete_object, Bucket=bucket, Key=k)
        return None

    def expired_unrenewed(self, key: str, expires: float) -> bool:
        """Watch a held lease for at most `SLIMCKPT_S3_LEASE_S`: True when it expires unrenewed (its holder
        is dead) or is released; False as soon as it is renewed (or taken by another), or when the watch
        ends first (a lease longer than ours, e.g. a holder with another setting: held)."""
        ttl = env_vars.seconds("SLIMCKPT_S3_LEASE_S")
        poll = min(1.0, max(0.05, ttl / 8))
        until = min(expires, time.time() + ttl)
        while time.time() <= until:
            time.sleep(min(poll, max(0.0, until - time.time()) + 0.01))
            held = self.lease_body(key)
            if held is None:
                return True
            if held.get("expires") != expires:
                return False
        return time.time() > expires

    def lease_body(self, key: str) -> dict | None:
        bucket, k = split(key)
        try:
            out = call(key, CLIENT.get().get_object, Bucket=bucket, Key=k)
            body = json.loads(out["Body"].read(65536).decode("utf-8"))
        except FileNotFoundError:
            return None
        except (ValueError, UnicodeDecodeError):
            return {}  # not one of ours: held, no expiry known
        return body if isinstance(body, dict) else {}

    def lease_note(self, key: str) -> str:
        try:
            body = self.lease_body(key)
        except OSError:
            return ""
        if not body:
            return ""
        note = str(body.get("note") or "").strip()
        if note:
            return note.splitlines()[0]
        holder = str(body.get("holder") or "")
        expires = body.get("expires")
        if holder and isinstance(expires, int | float):
            return f"{holder} (lease expires {time.strftime('%Y-%m-%d %H:%M:%S UTC', time.gmtime(expires))})"
        return holder

    # ------------------------------------------------------------------ directories

    def make_dirs(self, path: str, *, exist_ok: bool = False) -> None:
        pass  # a prefix exists as soon as a key under it does

    # ------------------------------------------------------------------ writes

    def create_ranges(
        self, path: str, size: int, *, sparse: bool = False
    ) -> S3RangeWriter:  # sparse: an upload reserves nothing anyway
        old = OPEN_RANGES.pop(path, None)
        if old is not None:
            old.upload.abort()
        writer = S3RangeWriter(Upload(path), size)
        if writer.upload.state == "open":
            OPEN_RANGES[path] = writer
        return writer

    def open_ranges(self, path: str) -> S3RangeWriter:
        writer = OPEN_RANGES.get(path)
        if writer is None:
            raise ValueError(
                f"{path}: S3 cannot reopen an object to write into it; write the file through the writer "
                f"create_ranges returned, in this process, its ranges in order"
            )
        return writer

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
        self.require_conditional_writes(path)
        return self.put_new(path, bytes(data))

    def put_new(self, path: str, data: bytes) -> bool:
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
                    return retries.attempt > 1 and self.holds(path, data)
                if code in ("ConditionalRequestConflict", "409"):
                    conflicts += 1
                    if conflicts < 2:
                        continue
                    return retries.attempt > 1 and self.holds(path, data)
                if code in ("NotImplemented", "501"):
                    raise no_conditional_writes(path) from None
                if retries.again(exc):
                    continue
                err = retries.failed(exc, path)
                if err is exc:
                    raise
                raise err from None

    def holds(self, path: str, data: bytes) -> bool:
        """Whether the object at `path` is exactly `data` (a small one: a manifest, a lease)."""
        try:
            return self.read_range(path, 0, len(data) + 1) == data
        except FileNotFoundError:
            return False

    def require_conditional_writes(self, path: str) -> None:
        """Raise S3NoConditionalWrites unless this bucket's server refuses a second `If-None-Match: *` PUT
        (checked once per bucket and process, with a probe key beside `path`, removed after)."""
        bucket, key = split(path)
        if bucket in CONDITIONAL_OK:
            return
        parent = key.rsplit("/", 1)[0] + "/" if "/" in key else ""
        probe = f"s3://{bucket}/{parent}{PROBE_NAME}{uuid.uuid4().hex}"
        try:
            first = self.put_new(probe, b"probe")
            second = self.put_new(probe, b"probe")
        finally:
            with contextlib.suppress(OSError):
                b, k = split(probe)
                call(probe, CLIENT.get().delete_object, Bucket=b, Key=k)
        if not first or second:
            raise no_conditional_writes(path)
        CONDITIONAL_OK.add(bucket)

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
        bucket, key = split(prefix)
        p = key.rstrip("/")
        count = 0
        for url in [u for u in OPEN_RANGES if self.under(u, prefix)]:
            upload = OPEN_RANGES.pop(url).upload
            count += upload.upload_id is not None
            upload.abort()
        client = CLIENT.get()
        marker: dict[str, str] = {}
        while True:
            out = call(prefix, client.list_multipart_uploads, Bucket=bucket, Prefix=p, **marker)
            for up in out.get("Uploads", []):
                k = up["Key"]
                if p and not (k == p or k.startswith(p + "/")):
                    continue
                with contextlib.suppress(FileNotFoundError):
                    call(
                        f"s3://{bucket}/{k}",
                        client.abort_multipart_upload,
                        Bucket=bucket,
                        Key=k,
                        UploadId=up["UploadId"],
                    )
                    count += 1
            if not out.get("IsTruncated"):
                return count
            marker = {"KeyMarker": out.get("NextKeyMarker", ""), "UploadIdMarker": out.get("NextUploadIdMarker", "")}

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
        for url in [u for u in OPEN_RANGES if self.under(u, path)]:
            OPEN_RANGES.pop(url).upload.abort()
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

    def under(self, url: str, prefix: str) -> bool:
        p = prefix.rstrip("/")
        return url == p or url.startswith(p + "/")

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
        if length <= 0:
            return b""
        bucket, key = split(path)

        def attempt() -> bytes:
            try:
                out = CLIENT.get().get_object(Bucket=bucket, Key=key, Range=f"bytes={offset}-{offset + length - 1}")
            except client_error() as exc:
                if code_of(exc) in ("InvalidRange", "416"):
                    return b""  # from past the end of the file
                raise
            return out["Body"].read()

        return retried(path, attempt)


__all__ = ["S3Lease", "S3RangeWriter", "S3Reader", "S3Storage", "StreamFile", "Upload", "split"]
