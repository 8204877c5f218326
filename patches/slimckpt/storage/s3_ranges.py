"""Ranged writes of S3 objects: `S3RangeWriter`, one writer per file putting its bytes in order from offset
0 with no gap (S3 cannot write into an object), each write continuing one `Upload` that the file's last
byte completes; a write out of order is refused (ValueError naming the path). `OPEN_RANGES` keeps the files
this process has begun, so that `reopen` continues one (a header written by a coordinator, then the rest)."""

from __future__ import annotations

from slimckpt.storage.base import RangeWriter
from slimckpt.storage.s3_client import under
from slimckpt.storage.s3_upload import Upload


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


def create(path: str, size: int) -> S3RangeWriter:
    """A new writer of the `size` bytes of `path` (an unfinished one this process had begun is aborted)."""
    old = OPEN_RANGES.pop(path, None)
    if old is not None:
        old.upload.abort()
    writer = S3RangeWriter(Upload(path), size)
    if writer.upload.state == "open":
        OPEN_RANGES[path] = writer
    return writer


def reopen(path: str) -> S3RangeWriter:
    """The writer `create` returned for `path` in this process, while its file is unfinished."""
    writer = OPEN_RANGES.get(path)
    if writer is None:
        raise ValueError(
            f"{path}: S3 cannot reopen an object to write into it; write the file through the writer "
            f"create_ranges returned, in this process, its ranges in order"
        )
    return writer


def drop_under(prefix: str) -> int:
    """Abort this process's unfinished ranged files under `prefix`: how many had begun a multipart upload."""
    count = 0
    for url in [u for u in OPEN_RANGES if under(u, prefix)]:
        upload = OPEN_RANGES.pop(url).upload
        count += upload.upload_id is not None
        upload.abort()
    return count


__all__ = ["OPEN_RANGES", "S3RangeWriter", "create", "drop_under", "reopen"]
