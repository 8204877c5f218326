"""Positional writes of planned byte ranges: headers, then row ranges cast in bounded chunks.

Each output file is created once at its final size (space reserved up front where the filesystem
allows, so a full disk fails before the long part), then any number of workers `os.pwrite` their
own disjoint ranges into it. A chunk is at most `chunk_bytes` of source, cast into a staging buffer
(without O_DIRECT, a chunk already in the output dtype is written straight from the mmap).

Reading, casting and writing overlap, each on its own threads: `direct_read.Prefetcher` reads the
source rows a few chunks ahead (O_DIRECT), the caller casts chunk k+1 into one of two staging
buffers, and a write-behind thread pwrites chunk k from the other. All three release the GIL, so one worker
keeps the disk busy; host memory is a few chunks. A cast chunk is placed in its staging buffer at
its file offset modulo `direct_io.ALIGN`, so all of it but a partial block at each end goes to
the disk with O_DIRECT (`direct_io` says why); where the filesystem refuses O_DIRECT, or
SLIMCKPT_DIRECT_IO=0, the same bytes go through the page cache and the mmap.
"""

from __future__ import annotations

import errno
import os
import queue
import threading
from collections.abc import Callable
from dataclasses import dataclass

import torch

from . import direct_io, direct_read, layout
from .manifest import DEFAULT_ALGO, describe_os_error, file_checksum, new_hasher
from .sources import CheckpointError, SourceTensor

DEFAULT_CHUNK_BYTES = 4 << 20  # of source; PIPELINE_DEPTH staging buffers + direct_read's read buffers
PIPELINE_DEPTH = 2  # chunks in flight: one being cast, one being written
OUT_DTYPES: dict[str, torch.dtype] = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


class OutputError(RuntimeError):
    """Writing the output failed (disk full, read-only...); the message names the file and the fix."""


Progress = Callable[[int], None]


def _os_error(exc: OSError, path: str, need: int | None = None) -> OutputError:
    return OutputError(describe_os_error(exc, path, need))


def create_files(root: str, plan: layout.Plan) -> None:
    """Create every planned file at its final size with its header written (coordinator only)."""
    need = sum(f.size for f in plan.files)
    for f in plan.files:
        path = os.path.join(root, f.name)
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
            try:
                _reserve(fd, f.size)
                _pwrite_all(fd, memoryview(f.header), 0)
            finally:
                os.close(fd)
        except OSError as exc:
            raise _os_error(exc, path, need) from None


def _reserve(fd: int, size: int) -> None:
    try:
        os.posix_fallocate(fd, 0, size)
    except OSError as exc:
        if exc.errno not in (errno.EOPNOTSUPP, errno.EINVAL, errno.ENOSYS):
            raise
        os.ftruncate(fd, size)  # filesystems without fallocate (some network ones): sparse file


def _pwrite_all(fd: int, data: memoryview, offset: int) -> None:
    while len(data):
        n = os.pwrite(fd, data, offset)
        if n <= 0:
            raise OSError(errno.EIO, "short write")
        data, offset = data[n:], offset + n


def _address(data: memoryview) -> int:
    import ctypes

    if not len(data) or data.readonly:
        return -1  # header bytes and the like: never aligned on purpose, written buffered
    return ctypes.addressof(ctypes.c_char.from_buffer(data))


def _as_bytes(t: torch.Tensor) -> memoryview:
    t = t.reshape(-1)
    if t.numel() == 0:
        return memoryview(b"")
    return memoryview(t.view(torch.uint8).numpy()).cast("B")


class _WriteBehind:
    """One thread that runs submitted writes in order; a failed write is re-raised to the caller at
    its next submit/flush, and later writes are dropped (the output is being discarded anyway)."""

    def __init__(self, write: Callable[[str, memoryview, int], None]) -> None:
        self._write = write
        self._todo: queue.Queue = queue.Queue(maxsize=PIPELINE_DEPTH)
        self.error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="slimckpt-write", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while True:
            item = self._todo.get()
            try:
                if item is None:
                    return
                file, data, offset, done = item
                try:
                    if self.error is None:
                        self._write(file, data, offset)
                except BaseException as exc:  # noqa: BLE001 - handed to the caller
                    self.error = exc
                finally:
                    if done is not None:
                        done()
            finally:
                self._todo.task_done()

    def _raise(self) -> None:
        if self.error is not None:
            raise self.error

    def submit(self, file: str, data: memoryview, offset: int, done: Callable[[], None] | None) -> None:
        self._raise()
        self._todo.put((file, data, offset, done))

    def flush(self) -> None:
        self._todo.join()
        self._raise()

    def stop(self) -> None:
        self._todo.put(None)
        self._thread.join()


class _StagingRing:
    """Two reusable cast buffers: a chunk is cast into a free one, which comes back once written.
    Reused buffers keep their pages faulted in; the ring bounds memory to PIPELINE_DEPTH chunks."""

    def __init__(self, min_bytes: int) -> None:
        self.min_bytes = min_bytes
        self._free: queue.Queue = queue.Queue()
        self._made = 0

    def take(self, nbytes: int) -> torch.Tensor:
        if self._free.empty() and self._made < PIPELINE_DEPTH:
            self._made += 1
            buf = None
        else:
            buf = self._free.get()
        if buf is None or buf.numel() < nbytes + direct_io.ALIGN:
            # slack for placing a chunk at its file offset modulo ALIGN (see ShareWriter._cast)
            buf = direct_io.aligned_empty(max(nbytes, self.min_bytes) + direct_io.ALIGN)
        return buf

    def give_back(self, buf: torch.Tensor) -> None:
        self._free.put(buf)


def _close(st: "_FileState") -> None:
    for fd in (st.fd, st.dfd):
        if fd is not None:
            try:
                os.close(fd)
            except OSError:
                pass


@dataclass
class _FileState:
    path: str
    fd: int
    dfd: int | None  # O_DIRECT descriptor of the same file, None where refused
    next_offset: int  # for the running checksum: where the next in-order write must start
    hasher: object | None


@dataclass
class _RowChunk:
    """Rows [start, end) of a dim-0 shard `piece`, written as `nbytes` at `offset` of `file`."""

    file: str
    piece: torch.Tensor
    start: int
    end: int
    offset: int
    nbytes: int  # in the output dtype


class ShareWriter:
    """Writes one worker's share of a plan into the files `create_files` made."""

    def __init__(self, root: str, plan: layout.Plan, sources: dict[str, SourceTensor], out_dtype: torch.dtype,
                 chunk_bytes: int = DEFAULT_CHUNK_BYTES, progress: Progress | None = None,
                 algo: str = DEFAULT_ALGO, fsync: bool = True) -> None:
        self.root, self.plan, self.sources, self.out_dtype = root, plan, sources, out_dtype
        self.out_width = torch.empty((), dtype=out_dtype).element_size()
        self.chunk_bytes = max(1, chunk_bytes)
        self.progress = progress or (lambda n: None)
        self.algo = algo
        self.fsync = fsync  # False only for `slimckpt merge --no_fsync`: not durable across a power loss
        self.direct = direct_io.enabled()
        self._files: dict[str, _FileState] = {}
        self._ring = _StagingRing(min(self.chunk_bytes, 1 << 30))
        self._behind: _WriteBehind | None = None
        self._pending_buf: torch.Tensor | None = None  # staging buffer of the last _cast, until submitted
        self._layouts = {f.name: f for f in plan.files}
        self.checksums: dict[str, str] = {}  # files this writer wrote whole, in order

    # -- files -----------------------------------------------------------------------------------
    def _file(self, name: str) -> _FileState:
        st = self._files.get(name)
        if st is None:
            path = os.path.join(self.root, name)
            try:
                fd = os.open(path, os.O_WRONLY)
            except OSError as exc:
                raise _os_error(exc, path) from None
            try:
                dfd = direct_io.open_direct(path, os.O_WRONLY) if self.direct else None
            except OSError:
                dfd = None
            f = self._layouts[name]
            hasher = new_hasher(self.algo)
            hasher.update(f.header)
            st = self._files[name] = _FileState(path, fd, dfd, f.data_start, hasher)
        return st

    def _pwrite(self, st: _FileState, data: memoryview, offset: int) -> None:
        """The aligned middle with O_DIRECT when possible, the rest (or all of it) buffered. The two
        parts never share a block, so the page cache never holds a stale copy of a direct block."""
        head, body, _tail = direct_io.split(offset, len(data), _address(data)) if st.dfd is not None else (len(data), 0, 0)
        if body:
            try:
                _pwrite_all(st.dfd, data[head:head + body], offset + head)
            except OSError as exc:
                if not direct_io.refused(exc):
                    raise
                os.close(st.dfd)  # this filesystem's alignment rules are stricter: buffered from now on
                st.dfd = None
                _pwrite_all(st.fd, data, offset)
                return
            _pwrite_all(st.fd, data[:head], offset)
            _pwrite_all(st.fd, data[head + body:], offset + head + body)
        else:
            _pwrite_all(st.fd, data, offset)

    def _write(self, file: str, data: memoryview, offset: int) -> None:
        st = self._file(file)
        try:
            self._pwrite(st, data, offset)
        except OSError as exc:
            raise _os_error(exc, st.path, sum(f.size for f in self.plan.files)) from None
        if st.hasher is not None:
            if offset == st.next_offset:
                st.hasher.update(data)
                st.next_offset += len(data)
            else:
                st.hasher = None  # not written in order by us alone: checksum by reading back
        self.progress(len(data))

    def _submit(self, file: str, data: memoryview, offset: int) -> None:
        """Queue a write; the staging buffer `data` may live in goes back to the ring once written."""
        buf, self._pending_buf = self._pending_buf, None
        if self._behind is None:
            self._behind = _WriteBehind(self._write)
        done = None if buf is None else (lambda: self._ring.give_back(buf))
        # the queued item keeps `data` (and the tensor under it) alive until it is written
        self._behind.submit(file, data, offset, done)

    def _stop_behind(self) -> BaseException | None:
        behind, self._behind = self._behind, None
        if behind is None:
            return None
        try:
            behind.flush()
        except BaseException as exc:  # noqa: BLE001 - returned for the caller to raise or drop
            return exc
        finally:
            behind.stop()
        return None

    def close(self) -> None:
        """fsync and close every file; keep the running checksum of files written whole."""
        failed = self._stop_behind()
        if failed is not None:
            self.abort()
            raise failed
        errors = []
        for name, st in self._files.items():
            try:
                if self.fsync:
                    os.fsync(st.fd)
            except OSError as exc:
                errors.append(_os_error(exc, st.path))
            finally:
                _close(st)
            if st.hasher is not None and st.next_offset == self._layouts[name].size:
                self.checksums[name] = st.hasher.hexdigest()
        self._files.clear()
        if errors:
            raise errors[0]

    # -- tensors ---------------------------------------------------------------------------------
    def write_share(self, share: list[layout.Segment]) -> None:
        items = self._chunks(share)
        row_chunks = [it.nbytes for it in items if isinstance(it, _RowChunk)]
        if row_chunks:  # cast buffers of the output size (half the source chunk for fp32 -> bf16)
            self._ring.min_bytes = max(row_chunks)
        prefetch = self._prefetcher(items)
        try:
            for i, item in enumerate(items):
                self._write_item(i, item, prefetch)
        except BaseException:
            self.abort()
            raise
        finally:
            if prefetch is not None:
                prefetch.close()
        self.close()

    def abort(self) -> None:
        """Close every file without fsync or checksums (the output is being discarded)."""
        self._stop_behind()
        for st in self._files.values():
            _close(st)
        self._files.clear()

    def _chunks(self, share: list[layout.Segment]) -> list[_RowChunk | layout.Segment]:
        """The share in write order: dim-0 shards as row chunks (each read, cast and written as one
        piece), other segments whole (their writers chunk them themselves)."""
        out: list[_RowChunk | layout.Segment] = []
        for seg in share:
            src = self.sources[seg.name]
            placement = self.plan.placements[seg.name]
            if seg.row_end <= seg.row_start or placement.end == placement.begin:
                continue
            if src.shard_dim != 0:
                out.append(seg)
                continue
            for sr in layout.source_ranges(placement, src.shard_sizes, seg.row_start, seg.row_end):
                t = src.pieces[sr.source]
                t = t.reshape(1) if t.dim() == 0 else t
                row_out = (t[0].numel() if t.shape[0] else 0) * self.out_width
                step = self._rows_per_chunk(t)
                offset = sr.begin
                for start in range(sr.local_start, sr.local_end, step):
                    end = min(sr.local_end, start + step)
                    chunk = _RowChunk(placement.file, t, start, end, offset, (end - start) * row_out)
                    out.append(chunk)
                    offset += chunk.nbytes
        return out

    def _prefetcher(self, items: list[_RowChunk | layout.Segment]) -> direct_read.Prefetcher | None:
        if not self.direct:
            return None
        paths = sorted({src.file_of(k) for src in self.sources.values() for k in range(len(src.pieces))
                        if src.local_dir})
        if not direct_io.supported(paths):
            return None
        files = direct_read.MappedFiles(paths)
        reads = [direct_read.rows_read(files, it.piece, it.start, it.end) if isinstance(it, _RowChunk) else None
                 for it in items]
        return direct_read.Prefetcher(reads) if any(reads) else None

    def _write_item(self, i: int, item: _RowChunk | layout.Segment, prefetch: direct_read.Prefetcher | None) -> None:
        if not isinstance(item, _RowChunk):
            src = self.sources[item.name]
            placement = self.plan.placements[item.name]
            if src.shard_dim is not None:
                self._write_cat_rows(placement, src, item.row_start, item.row_end)
            else:
                self._write_plain(placement, src, item.row_start, item.row_end)
            return
        if prefetch is not None and prefetch.has(i):
            data = _as_bytes(self._cast(prefetch.get(i), item.offset, borrowed=True))
        else:
            data = _as_bytes(self._cast(item.piece[item.start:item.end], item.offset))
        self._submit(item.file, data, item.offset)

    def _cast(self, src: torch.Tensor, offset: int, borrowed: bool = False) -> torch.Tensor:
        """`src` in the output dtype, contiguous, in a reused staging buffer at `offset` modulo
        ALIGN (so the write can bypass the page cache). Without O_DIRECT, a source that already is
        in the output dtype is returned as is (written straight from the mmap); a `borrowed` one (a
        prefetch buffer, reused at the next read) is always copied."""
        if src.dtype == self.out_dtype and src.is_contiguous() and not borrowed and not self.direct:
            return src
        nbytes = src.numel() * self.out_width
        if self._pending_buf is not None:  # cast but never submitted (a check failed): reuse it
            self._ring.give_back(self._pending_buf)
        self._pending_buf = buf = self._ring.take(nbytes)
        shift = offset % direct_io.ALIGN
        out = buf[shift:shift + nbytes].view(self.out_dtype).view(src.shape)
        out.copy_(src)
        return out

    def _rows_per_chunk(self, t: torch.Tensor) -> int:
        per_row = max(1, t[0].numel() if t.dim() and t.shape[0] else 1)
        width = max(t.element_size(), self.out_width)
        return max(1, self.chunk_bytes // (per_row * width))

    def _write_cat_rows(self, placement: layout.Placement, src: SourceTensor, a: int, b: int) -> None:
        """Shard(d>0): each output row is the concatenation of every shard's slice of that row."""
        step = max(1, self._rows_per_chunk(src.pieces[0]) // max(1, len(src.pieces)))
        offset = placement.rows_to_bytes(a, b)[0]
        for start in range(a, b, step):
            end = min(b, start + step)
            chunk = torch.cat([p[start:end].to(self.out_dtype) for p in src.pieces], dim=src.shard_dim)
            data = _as_bytes(chunk.contiguous())
            self._submit(placement.file, data, offset)
            offset += len(data)

    def _write_plain(self, placement: layout.Placement, src: SourceTensor, a: int, b: int) -> None:
        """An unsharded tensor: rank 0's copy, after checking the others equal it as verl does."""
        first = src.pieces[0].reshape(1) if src.pieces[0].dim() == 0 else src.pieces[0]
        others = [p.reshape(1) if p.dim() == 0 else p for p in src.pieces[1:]]
        step = self._rows_per_chunk(first)
        offset = placement.rows_to_bytes(a, b)[0]
        for start in range(a, b, step):
            end = min(b, start + step)
            chunk = self._cast(first[start:end], offset)
            for k, other in enumerate(others, start=1):
                # verl compares the copies after its bf16 cast; compare after ours
                if not torch.equal(other[start:end].to(self.out_dtype), chunk):
                    raise CheckpointError(
                        f"{src.file_of(k)}: unsharded entry {src.name!r} differs from rank {src.ranks[0]}'s copy; "
                        f"the rank files come from different steps: re-copy the checkpoint")
            data = _as_bytes(chunk)
            self._submit(placement.file, data, offset)
            offset += len(data)


def checksum_files(root: str, names: list[str], algo: str = DEFAULT_ALGO) -> dict[str, str]:
    """Read-back checksums of whole files (those no single writer wrote in order)."""
    return {name: file_checksum(os.path.join(root, name), algo) for name in names}
