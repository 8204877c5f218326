"""Checksums of DCP's files computed while DCP writes them, so a commit need not read them back.

Reading a step's files back to checksum them costs a second pass over every byte; at 1B
parameters on a 24 GB host the page cache no longer holds them and that pass went to disk (10.7 s
of a 28.5 s save). DCP's `FileSystemWriter` writes each rank file strictly in order through
`stream.write` (tensors via torch.save into a write-only wrapper), so hashing each buffer as it is
written gives the file's checksum for free. `HashingFileSystem` is the FileSystem a writer uses;
after `dcp.save` its `checksums` map each file path to the hex digest, in the manifest's algorithm.
A stream that is ever seeked, or written by other means, is left out: the commit then reads that
file back as before, so a wrong checksum can never be recorded.

Every file DCP writes goes through the storage of its path (`Storage.open_stream`: a local file,
fsynced at its end; an object store's multipart upload, completed at its end), so the same writer
saves to a local dir and to an `s3://` prefix. A URL stays a string: torch's FileSystem would make
it a Path and fold its "//".
"""

from __future__ import annotations

import io
import os
import threading
from collections.abc import Generator
from contextlib import contextmanager

from torch.distributed.checkpoint.filesystem import FileSystem

from slimckpt.layout.merge_manifest import DEFAULT_ALGO, new_hasher
from slimckpt.storage import absolute, for_path, is_url


class _HashingStream(io.RawIOBase):
    """A write-only file stream that hashes what goes through `write`, in order."""

    def __init__(self, raw, algo: str) -> None:
        super().__init__()
        self.raw = raw
        self.hasher = new_hasher(algo)
        self.in_order = True

    def writable(self) -> bool:
        return True

    def write(self, b) -> int:
        view = memoryview(b).cast("B")
        n = self.raw.write(view)
        if n is None or n != len(view):
            self.in_order = False  # a short write would be retried by the caller with other bytes
        else:
            self.hasher.update(view)
        return n

    def tell(self) -> int:
        return self.raw.tell()

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        self.in_order = False
        return self.raw.seek(offset, whence)

    def fileno(self) -> int:
        return self.raw.fileno()

    def flush(self) -> None:
        if not self.raw.closed:
            self.raw.flush()

    def close(self) -> None:
        if not self.closed:
            self.raw.close()  # flushes it
        super().close()


class HashingFileSystem(FileSystem):
    def __init__(self, algo: str = DEFAULT_ALGO) -> None:
        super().__init__()
        self.algo = algo
        self.checksums: dict[str, str] = {}
        self._lock = threading.Lock()

    @contextmanager
    def create_stream(self, path: str | os.PathLike, mode: str) -> Generator[io.IOBase, None, None]:
        name = str(path)
        if mode != "wb":
            if not is_url(name):
                with super().create_stream(path, mode) as stream:
                    yield stream
                return
            with for_path(name).open_read(name) as stream:
                yield stream
            return
        with for_path(name).open_stream(name) as raw:
            stream = _HashingStream(raw, self.algo)
            try:
                yield stream
            finally:
                if stream.in_order:
                    with self._lock:
                        self.checksums[absolute(name)] = stream.hasher.hexdigest()

    def rename(self, path: str | os.PathLike, new_path: str | os.PathLike) -> None:
        if is_url(str(path)):
            for_path(str(path)).replace(str(path), str(new_path))
        else:
            super().rename(path, new_path)
        with self._lock:
            digest = self.checksums.pop(absolute(str(path)), None)
            if digest is not None:
                self.checksums[absolute(str(new_path))] = digest

    # a URL stays a string (torch's FileSystem makes every path a Path); a plain path is torch's

    def init_path(self, path: str | os.PathLike) -> str | os.PathLike:
        return str(path) if is_url(str(path)) else super().init_path(path)

    def concat_path(self, path: str | os.PathLike, suffix: str) -> str | os.PathLike:
        return f"{str(path).rstrip('/')}/{suffix}" if is_url(str(path)) else super().concat_path(path, suffix)

    def mkdir(self, path: str | os.PathLike) -> None:
        if is_url(str(path)):
            for_path(str(path)).make_dirs(str(path), exist_ok=True)
        else:
            super().mkdir(path)

    def exists(self, path: str | os.PathLike) -> bool:
        return for_path(str(path)).exists(str(path)) if is_url(str(path)) else super().exists(path)

    def rm_file(self, path: str | os.PathLike) -> None:
        if is_url(str(path)):
            for_path(str(path)).remove(str(path))
        else:
            super().rm_file(path)

    def ls(self, path: str | os.PathLike) -> list[str]:
        if not is_url(str(path)):
            return super().ls(path)
        return [f"{str(path).rstrip('/')}/{n}" for n in for_path(str(path)).list_dir(str(path))]
