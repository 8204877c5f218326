"""Writing one S3 object in order, in bounded memory: `Upload` gathers the bytes into parts of
`SLIMCKPT_S3_PART_MB` and sends each as it fills (a multipart upload begun at the first full part, a file
smaller than a part is one PUT at the end), completed by `finish`, dropped by `abort`. `StreamFile` is the
write-only file `open_stream` yields over one.

Memory: the process's `Budget` bounds the parts in flight (the rest of `SLIMCKPT_S3_CONCURRENCY` beside
the one a writer fills; a writer waits while they all are in flight) and reuses their buffers.
"""

from __future__ import annotations

import contextlib
import hashlib
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from slimckpt.storage.s3_client import CLIENT, MIB, Retries, call, code_of, concurrency, part_bytes, split
from slimckpt.storage.s3_errors import S3Error
from slimckpt.storage.s3_read import Positioned

MAX_PARTS = 10_000


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


def abort_unfinished(prefix: str) -> int:
    """Abort every multipart upload the bucket lists under `prefix` (another process's, or one whose
    process died): how many."""
    bucket, key = split(prefix)
    p = key.rstrip("/")
    count = 0
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


__all__ = [
    "BUDGET",
    "MAX_PARTS",
    "Budget",
    "BudgetHolder",
    "PartBody",
    "StreamFile",
    "Upload",
    "abort_unfinished",
    "multipart_etag",
]
