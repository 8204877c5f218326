"""Reads of S3 objects: `S3Reader`, the seekable reader `open_read` gives (ranged GETs of `READ_BLOCK`, one
block held), `read_range` (one ranged GET), and `Positioned`, the seekable raw file a reader and an upload's
part body both are."""

from __future__ import annotations

import io
from typing import Any

from slimckpt.storage.s3_client import CLIENT, MIB, client_error, code_of, retried, split

READ_BLOCK = 8 * MIB


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


def read_range(path: str, offset: int, length: int) -> bytes:
    """`length` bytes of the object at `path` from `offset` (fewer at its end, none past it)."""
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


__all__ = ["READ_BLOCK", "Positioned", "S3Reader", "read_range"]
