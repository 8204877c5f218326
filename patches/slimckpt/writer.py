"""Positional writes of planned byte ranges: headers, then row ranges cast in bounded chunks.

Each output file is created once at its final size (space reserved up front where the filesystem
allows, so a full disk fails before the long part), then any number of workers `os.pwrite` their
own disjoint ranges into it. A chunk is at most `chunk_bytes` of output (plus the source slice it
is cast from); an uncast chunk is written straight from the memory-mapped shard.

Casting (CPU, and the page-ins of the memory-mapped source) and writing (disk) overlap: the caller
casts chunk k+1 into one of two staging buffers while a writer thread pwrites chunk k from the
other. Both release the GIL, so one worker keeps the disk busy; host memory is two chunks.
"""

from __future__ import annotations

import errno
import os
import queue
import threading
from collections.abc import Callable
from dataclasses import dataclass

import torch

from . import layout
from .manifest import DEFAULT_ALGO, describe_os_error, file_checksum, new_hasher
from .sources import CheckpointError, SourceTensor

DEFAULT_CHUNK_BYTES = 16 << 20  # x PIPELINE_DEPTH staging buffers
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
        if buf is None or buf.numel() < nbytes:
            buf = torch.empty(max(nbytes, self.min_bytes), dtype=torch.uint8)
        return buf

    def give_back(self, buf: torch.Tensor) -> None:
        self._free.put(buf)


@dataclass
class _FileState:
    path: str
    fd: int
    next_offset: int  # for the running checksum: where the next in-order write must start
    hasher: object | None


class ShareWriter:
    """Writes one worker's share of a plan into the files `create_files` made."""

    def __init__(self, root: str, plan: layout.Plan, sources: dict[str, SourceTensor], out_dtype: torch.dtype,
                 chunk_bytes: int = DEFAULT_CHUNK_BYTES, progress: Progress | None = None,
                 algo: str = DEFAULT_ALGO, fsync: bool = True) -> None:
        self.root, self.plan, self.sources, self.out_dtype = root, plan, sources, out_dtype
        self.chunk_bytes = max(1, chunk_bytes)
        self.progress = progress or (lambda n: None)
        self.algo = algo
        self.fsync = fsync  # False only for `slimckpt merge --no_fsync`: not durable across a power loss
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
            f = self._layouts[name]
            hasher = new_hasher(self.algo)
            hasher.update(f.header)
            st = self._files[name] = _FileState(path, fd, f.data_start, hasher)
        return st

    def _write(self, file: str, data: memoryview, offset: int) -> None:
        st = self._file(file)
        try:
            _pwrite_all(st.fd, data, offset)
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
                os.close(st.fd)
            if st.hasher is not None and st.next_offset == self._layouts[name].size:
                self.checksums[name] = st.hasher.hexdigest()
        self._files.clear()
        if errors:
            raise errors[0]

    # -- tensors ---------------------------------------------------------------------------------
    def write_share(self, share: list[layout.Segment]) -> None:
        try:
            for seg in share:
                self.write_segment(seg)
        except BaseException:
            self.abort()
            raise
        self.close()

    def abort(self) -> None:
        """Close every file without fsync or checksums (the output is being discarded)."""
        self._stop_behind()
        for st in self._files.values():
            try:
                os.close(st.fd)
            except OSError:
                pass
        self._files.clear()

    def write_segment(self, seg: layout.Segment) -> None:
        src = self.sources[seg.name]
        placement = self.plan.placements[seg.name]
        if seg.row_end <= seg.row_start or placement.end == placement.begin:
            return
        if src.shard_dim == 0:
            for sr in layout.source_ranges(placement, src.shard_sizes, seg.row_start, seg.row_end):
                self._write_rows(placement, src.pieces[sr.source], sr.local_start, sr.local_end, sr.begin)
        elif src.shard_dim is not None:
            self._write_cat_rows(placement, src, seg.row_start, seg.row_end)
        else:
            self._write_plain(placement, src, seg.row_start, seg.row_end)

    def _cast(self, src: torch.Tensor) -> torch.Tensor:
        """`src` in the output dtype, contiguous: the source itself when it already is (no copy,
        written straight from the memory-mapped shard), else a view of the reused staging buffer."""
        if src.dtype == self.out_dtype and src.is_contiguous():
            return src
        nbytes = src.numel() * torch.empty((), dtype=self.out_dtype).element_size()
        if self._pending_buf is not None:  # cast but never submitted (a check failed): reuse it
            self._ring.give_back(self._pending_buf)
        self._pending_buf = buf = self._ring.take(nbytes)
        out = buf[:nbytes].view(self.out_dtype).view(src.shape)
        out.copy_(src)
        return out

    def _rows_per_chunk(self, t: torch.Tensor) -> int:
        per_row = max(1, t[0].numel() if t.dim() and t.shape[0] else 1)
        width = max(t.element_size(), torch.empty((), dtype=self.out_dtype).element_size())
        return max(1, self.chunk_bytes // (per_row * width))

    def _write_rows(self, placement: layout.Placement, t: torch.Tensor, a: int, b: int, offset: int) -> None:
        """Rows [a, b) of a dim-0 shard (or of a plain tensor) to absolute `offset`, cast in chunks."""
        if t.dim() == 0:
            t = t.reshape(1)
        step = self._rows_per_chunk(t)
        for start in range(a, b, step):
            end = min(b, start + step)
            data = _as_bytes(self._cast(t[start:end]))
            self._submit(placement.file, data, offset)
            offset += len(data)

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
            chunk = self._cast(first[start:end])
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
