"""Source rows read with O_DIRECT on a thread, a few chunks ahead of the cast.

The readers (`sources.py`) open rank files with `torch.load(mmap=True)`; touching those tensors
pages them in through the page cache, one fault at a time, which is what a merge should not wait
on (see `direct_io`). Here the writer hands over, up front, the list of row chunks it will cast in
order; a thread `preadv`s each chunk's bytes straight from the rank file into one of a few reused
aligned buffers while the caller casts the previous one and the write-behind thread writes the one
before. Where a chunk sits in its file comes from the mmap itself (`/proc/self/maps`), so the zip
layout of `torch.save` is never parsed here.

Memory: `DEPTH + 1` buffers of the largest chunk (the one being cast, the ones read ahead).
"""

from __future__ import annotations

import os
import queue
import threading
from dataclasses import dataclass

import torch

from . import direct_io
from .sources import CheckpointError

DEPTH = 2  # chunks read ahead of the one being cast


@dataclass(frozen=True)
class ChunkRead:
    """Bytes [offset, offset + nbytes) of `path`, to be viewed as `shape` of `dtype`."""

    path: str
    offset: int
    nbytes: int
    dtype: torch.dtype
    shape: tuple[int, ...]


@dataclass(frozen=True)
class _Mapping:
    start: int
    end: int
    file_offset: int
    path: str


class MappedFiles:
    """Where the bytes of tensors memory-mapped from `paths` sit in those files."""

    def __init__(self, paths: list[str]) -> None:
        wanted = {os.path.realpath(p): p for p in paths}
        self._maps: list[_Mapping] = []
        try:
            with open("/proc/self/maps") as f:
                lines = f.read().splitlines()
        except OSError:
            return  # not Linux: no locations, callers use the mmap
        for line in lines:
            parts = line.split(maxsplit=5)
            if len(parts) < 6:
                continue
            path = parts[5]
            if path not in wanted:
                continue
            lo, hi = (int(x, 16) for x in parts[0].split("-"))
            self._maps.append(_Mapping(lo, hi, int(parts[2], 16), wanted[path]))

    def locate(self, t: torch.Tensor) -> tuple[str, int] | None:
        """(file, byte offset) of a contiguous CPU tensor's data, or None when it is not file-backed."""
        if t.device.type != "cpu" or not t.is_contiguous() or t.numel() == 0:
            return None
        ptr, nbytes = t.data_ptr(), t.numel() * t.element_size()
        for m in self._maps:
            if m.start <= ptr and ptr + nbytes <= m.end:
                return m.path, ptr - m.start + m.file_offset
        return None


def rows_read(files: MappedFiles, piece: torch.Tensor, a: int, b: int) -> ChunkRead | None:
    """The read that yields rows [a, b) of a dim-0 shard, or None if it cannot be read directly."""
    where = files.locate(piece)
    if where is None:
        return None
    path, base = where
    row_bytes = (piece[0].numel() if piece.dim() else 1) * piece.element_size()
    shape = (b - a, *piece.shape[1:]) if piece.dim() else (b - a,)
    return ChunkRead(path, base + a * row_bytes, (b - a) * row_bytes, piece.dtype, shape)


class Prefetcher:
    """Reads `reads` in order on a thread; `get(i)` returns read i (skipping None entries, which the
    caller serves from the mmap). A returned tensor stays valid until the next `get`."""

    def __init__(self, reads: list[ChunkRead | None]) -> None:
        self._reads = reads
        spans = [direct_io.align_up(r.offset + r.nbytes) - direct_io.align_down(r.offset) for r in reads if r]
        self._buf_bytes = max(spans, default=0)
        self._free: queue.Queue = queue.Queue()
        for _ in range(DEPTH + 1):
            self._free.put(direct_io.aligned_empty(self._buf_bytes))
        self._ready: queue.Queue = queue.Queue()
        self._held: torch.Tensor | None = None
        self._stop = False
        self._fds: dict[str, tuple[int | None, int]] = {}
        self._thread = threading.Thread(target=self._run, name="slimckpt-read", daemon=True)
        self._thread.start()

    def _fd(self, path: str) -> tuple[int | None, int]:
        fds = self._fds.get(path)
        if fds is None:
            fds = self._fds[path] = (direct_io.open_direct(path, os.O_RDONLY), os.open(path, os.O_RDONLY))
        return fds

    def _read_into(self, buf: torch.Tensor, r: ChunkRead) -> torch.Tensor:
        start = direct_io.align_down(r.offset)
        span = direct_io.align_up(r.offset + r.nbytes) - start
        mv = memoryview(buf.numpy())[:span]
        need = r.offset + r.nbytes - start
        dfd, fd = self._fd(r.path)
        got = 0
        while got < need:
            try:
                n = os.preadv(dfd if dfd is not None else fd, [mv[got:]], start + got)
            except OSError as exc:
                if dfd is None or not direct_io.refused(exc):
                    raise CheckpointError(f"{r.path}: read failed at byte {start + got} ({exc.strerror}); "
                                          f"check the disk, or re-copy the file from the training run") from None
                dfd = None  # this transfer is not O_DIRECT-able here: finish it buffered
                continue
            if n == 0:
                raise CheckpointError(f"{r.path}: ends at byte {start + got} but a tensor needs bytes up to "
                                      f"{r.offset + r.nbytes}; the file is truncated: re-copy it from the training run")
            got += n
        skip = r.offset - start
        return buf[skip:skip + r.nbytes].view(r.dtype).view(r.shape)

    def _run(self) -> None:
        try:
            for i, r in enumerate(self._reads):
                if r is None:
                    continue
                buf = self._free.get()
                if self._stop:
                    return
                try:
                    self._ready.put((i, self._read_into(buf, r), buf))
                except BaseException as exc:  # noqa: BLE001 - re-raised by get()
                    self._ready.put((i, exc, buf))
                    return
        finally:
            for dfd, fd in self._fds.values():
                if dfd is not None:
                    os.close(dfd)
                os.close(fd)

    def has(self, i: int) -> bool:
        return self._reads[i] is not None

    def get(self, i: int) -> torch.Tensor:
        self._release()
        j, t, buf = self._ready.get()
        self._held = buf
        if isinstance(t, BaseException):
            raise t
        assert j == i, f"prefetched chunk {j}, asked for {i}"
        return t

    def _release(self) -> None:
        if self._held is not None:
            self._free.put(self._held)
            self._held = None

    def close(self) -> None:
        """Stop reading ahead (after an error, say) and wait for the thread."""
        self._stop = True
        self._release()
        self._free.put(None)  # wakes the thread if it waits for a buffer
        self._thread.join()
