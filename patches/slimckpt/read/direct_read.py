"""Source rows read with O_DIRECT on a thread, a few chunks ahead of the cast.

The readers (`sources.py`) open rank files with `torch.load(mmap=True)`; touching those tensors
pages them in through the page cache, one fault at a time, which is what a merge should not wait
on (see `direct_io`). Here the writer hands over, up front, the list of row chunks it will cast in
order; reader threads `preadv` each chunk's bytes straight from the rank file into one of a few reused
aligned buffers while the caller casts the previous one and the write-behind thread writes the one
before. Where a chunk sits in its file comes from the mmap itself (`/proc/self/maps`), so the zip
layout of `torch.save` is never parsed here.

Memory: `READERS + DEPTH` buffers of the largest chunk (4 MiB at the merge's default 2 MiB chunks).
"""

from __future__ import annotations

import os
import queue
import threading
import time
from dataclasses import dataclass

from . import direct_io
from .checkpoint_dir import CheckpointError

READERS = 1  # reads in flight. One reader a chunk ahead was as fast as two readers two chunks ahead,
# with less memory (fewer buffers, and no malloc arena of a second reader thread); measured:
# BENCHMARKS.md, Figures quoted in the code
DEPTH = 1  # buffers beyond one per reader: the chunk being cast while the next is read


@dataclass(frozen=True)
class ChunkRead:
    """Bytes [offset, offset + nbytes) of `path` (the caller knows what they hold)."""

    path: str
    offset: int
    nbytes: int


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

    def locate(self, t) -> tuple[str, int] | None:
        """(file, byte offset) of a contiguous CPU tensor's data, or None when it is not file-backed."""
        if t.device.type != "cpu" or not t.is_contiguous() or t.numel() == 0:
            return None
        ptr, nbytes = t.data_ptr(), t.numel() * t.element_size()
        for m in self._maps:
            if m.start <= ptr and ptr + nbytes <= m.end:
                return m.path, ptr - m.start + m.file_offset
        return None


def rows_read(files: MappedFiles, piece, a: int, b: int) -> ChunkRead | None:
    """The read that yields rows [a, b) of a dim-0 shard (a torch tensor mapped from one of
    `files`), or None if it cannot be read directly."""
    where = files.locate(piece)
    if where is None:
        return None
    path, base = where
    row_bytes = (piece[0].numel() if piece.dim() else 1) * piece.element_size()
    return ChunkRead(path, base + a * row_bytes, (b - a) * row_bytes)


class Prefetcher:
    """Reads `reads` in order on READERS threads (a disk serves more with a few reads in flight);
    `get(i)` returns read i's bytes, in order (None entries are skipped: the caller serves them
    from the mmap). A returned memoryview stays valid until the next `get`.

    A reader takes a free buffer before it claims the next read, so the oldest read not yet handed
    out always has a buffer or can get one: no deadlock whatever the thread timing."""

    def __init__(self, reads: list[ChunkRead | None]) -> None:
        self._reads = reads
        self._order = [i for i, r in enumerate(reads) if r is not None]
        spans = [direct_io.align_up(r.offset + r.nbytes) - direct_io.align_down(r.offset) for r in reads if r]
        buf_bytes = max(spans, default=0)
        self._free: queue.Queue = queue.Queue()
        for _ in range(READERS + DEPTH):
            self._free.put(memoryview(direct_io.aligned_buffer(buf_bytes)))
        self._lock = threading.Lock()
        self._cond = threading.Condition(self._lock)
        self._claimed = 0  # position in _order of the next read to start
        self._done: dict[int, tuple[memoryview | BaseException, memoryview]] = {}
        self._held: memoryview | None = None
        self._stop = False
        self._fds: dict[str, tuple[int | None, int]] = {}
        # where the read threads spent their time, summed over threads (writer_stats)
        self.read_s = self.wait_buffer_s = 0.0
        self.read_bytes = 0
        n = min(READERS, len(self._order)) or 1
        self.threads = [threading.Thread(target=self._run, name=f"slimckpt-read-{k}", daemon=True) for k in range(n)]
        for t in self.threads:
            t.start()

    def _fd(self, path: str) -> tuple[int | None, int]:
        with self._lock:
            fds = self._fds.get(path)
            if fds is None:
                fds = self._fds[path] = (direct_io.open_direct(path, os.O_RDONLY), os.open(path, os.O_RDONLY))
        return fds

    def _read_into(self, buf: memoryview, r: ChunkRead) -> memoryview:
        start = direct_io.align_down(r.offset)
        span = direct_io.align_up(r.offset + r.nbytes) - start
        mv = buf[:span]
        need = r.offset + r.nbytes - start
        dfd, fd = self._fd(r.path)
        got = 0
        while got < need:
            try:
                n = os.preadv(dfd if dfd is not None else fd, [mv[got:]], start + got)
            except OSError as exc:
                if dfd is None or not direct_io.refused(exc):
                    raise CheckpointError(
                        f"{r.path}: read failed at byte {start + got} ({exc.strerror}); "
                        f"check the disk, or re-copy the file from the training run"
                    ) from None
                direct_io.page_cache_fallback(r.path, exc)
                dfd = None  # this transfer is not O_DIRECT-able here: finish it buffered
                continue
            if n == 0:
                raise CheckpointError(
                    f"{r.path}: ends at byte {start + got} but a tensor needs bytes up to "
                    f"{r.offset + r.nbytes}; the file is truncated: re-copy it from the training run"
                )
            got += n
        skip = r.offset - start
        return buf[skip : skip + r.nbytes]

    def _run(self) -> None:
        read_s = wait_s = 0.0
        read_bytes = 0
        try:
            while True:
                t = time.perf_counter()
                buf = self._free.get()
                wait_s += time.perf_counter() - t
                with self._lock:
                    if buf is None or self._stop or self._claimed >= len(self._order):
                        if buf is not None:
                            self._free.put(buf)
                        return
                    pos = self._claimed
                    self._claimed += 1
                i = self._order[pos]
                t = time.perf_counter()
                try:
                    result: memoryview | BaseException = self._read_into(buf, self._reads[i])
                    read_bytes += self._reads[i].nbytes
                except BaseException as exc:  # noqa: BLE001 - re-raised by get()
                    result = exc
                read_s += time.perf_counter() - t
                self._hand_over(i, result, buf)
        finally:
            with self._lock:
                self.read_s += read_s
                self.wait_buffer_s += wait_s
                self.read_bytes += read_bytes

    def _hand_over(self, i: int, result: memoryview | BaseException, buf: memoryview) -> None:
        with self._cond:
            self._done[i] = (result, buf)
            if isinstance(result, BaseException):
                self._stop = True  # nothing after a failed read is needed
            self._cond.notify_all()

    def has(self, i: int) -> bool:
        return self._reads[i] is not None

    def get(self, i: int) -> memoryview:
        self._release()
        with self._cond:
            while i not in self._done:
                self._cond.wait()
            result, buf = self._done.pop(i)
        self._held = buf
        if isinstance(result, BaseException):
            raise result
        return result

    def _release(self) -> None:
        if self._held is not None:
            self._free.put(self._held)
            self._held = None

    def close(self) -> None:
        """Stop reading ahead (after an error, say), wait for the threads, close the files."""
        with self._lock:
            self._stop = True
        self._release()
        for _ in self.threads:
            self._free.put(None)  # wakes a thread that waits for a buffer
        for t in self.threads:
            t.join()
        for dfd, fd in self._fds.values():
            if dfd is not None:
                os.close(dfd)
            os.close(fd)
        self._fds.clear()
