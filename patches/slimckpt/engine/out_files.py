"""**The** range writer: bytes written at their offsets of files created at their final size (the
storage's ranged writes), behind the caster, with running checksums and fsync at the end.

Every tool that writes a checkpoint's bytes in place writes them here: the merge
(`share_writer.ShareWriter` reads and casts the chunks of its shares), the in-training gather-free
export (each rank's boxes, `save.export.direct_write`) and `slimckpt convert` (a rank file laid out by
`torch.save`, filled tensor by tensor: `convert.rank_file`). Staging buffers are handed out by
`StagingRing`, which the caster fills and the writer gives back once the bytes are on their way to
the disk; with `write_behind` threads write chunks k and k-1 while the caster fills chunk k+1,
without it each write happens on the caller's thread (one buffer: the export's budget).

A writer that says where its staging buffers lie in memory (`address`: the merge) has each chunk
cast at an address congruent to its file offset modulo `DIRECT_ALIGN`, and its whole aligned blocks
written around the page cache (O_DIRECT, where the filesystem takes it), two writes in flight: on
the disks measured, buffered writes of a merge's output ran behind the page cache's writeback and
slowed the reads of its input beside them (BENCHMARKS.md, Figures quoted in the code). Everything
else goes through the page cache with `pwrite`. Running checksums and progress are taken in the
caller's order, before a write is queued.

No torch here, by design.
"""

from __future__ import annotations

import os
import queue
import threading
from collections.abc import Callable
from dataclasses import dataclass

import slimckpt.layout.safetensors_layout as layout
from slimckpt import SlimckptError
from slimckpt.engine.race_points import pause
from slimckpt.layout.merge_manifest import DEFAULT_ALGO, new_hasher
from slimckpt.storage import RangeWriter, for_path
from slimckpt.storage.base import DIRECT_ALIGN
from slimckpt.storage.os_errors import os_failure

PIPELINE_DEPTH = 2  # chunks in flight through the page cache: one being cast, one being written
DIRECT_WRITERS = 2  # write threads of a writer around the page cache: two requests in flight

Progress = Callable[[int], None]


class OutputError(SlimckptError, RuntimeError):
    """Writing the output failed (disk full, read-only...); the message names the file and the fix."""


def os_error(exc: OSError, path: str, need: int | None = None) -> OutputError:
    return os_failure(OutputError, exc, path, need)


def create_files(root: str, plan: layout.Plan) -> None:
    """Create every planned file at its final size with its header written (coordinator only)."""
    need = sum(f.size for f in plan.files)
    for f in plan.files:
        path = os.path.join(root, f.name)
        try:
            out = for_path(path).create_ranges(path, f.size)
            try:
                out.write(memoryview(f.header), 0)
            finally:
                out.close()
        except OSError as exc:
            raise os_error(exc, path, need) from None


class _WriteBehind:
    """`threads` threads that run submitted writes (in order with one thread); a failed write is
    re-raised to the caller at its next submit/flush, and later writes are dropped (the output is
    being discarded anyway)."""

    def __init__(self, write: Callable[[_FileState, memoryview, int, bool], None], threads: int = 1) -> None:
        self._write = write
        self._todo: queue.Queue = queue.Queue(maxsize=PIPELINE_DEPTH)
        self.error: BaseException | None = None
        self._threads = [
            threading.Thread(target=self._run, name=f"slimckpt-write-{k}", daemon=True) for k in range(threads)
        ]
        for t in self._threads:
            t.start()

    def _run(self) -> None:
        while True:
            item = self._todo.get()
            try:
                if item is None:
                    return
                file, data, offset, direct, done = item
                try:
                    if self.error is None:
                        self._write(file, data, offset, direct)
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

    def submit(
        self, file: _FileState, data: memoryview, offset: int, direct: bool, done: Callable[[], None] | None
    ) -> None:
        self._raise()
        self._todo.put((file, data, offset, direct, done))

    def flush(self) -> None:
        self._todo.join()
        self._raise()

    def stop(self) -> None:
        for _ in self._threads:
            self._todo.put(None)
        for t in self._threads:
            t.join()


class StagingRing:
    """`size` reusable cast buffers: a chunk is cast into a free one, which comes back once
    written. Reused buffers keep their pages faulted in; the ring bounds memory to a few chunks.
    `alloc(n)` makes a 1-D byte buffer whose `len()` is n."""

    def __init__(self, min_bytes: int, alloc: Callable[[int], object], size: int = PIPELINE_DEPTH) -> None:
        self.min_bytes = min_bytes
        self._alloc = alloc
        self.size = size
        self._free: queue.Queue = queue.Queue()
        self._made = 0

    def take(self, nbytes: int) -> object:
        if self._free.empty() and self._made < self.size:
            self._made += 1
            buf = None
        else:
            buf = self._free.get()
        if buf is None or len(buf) < nbytes:
            buf = self._alloc(max(nbytes, self.min_bytes))
        return buf

    def give_back(self, buf: object) -> None:
        self._free.put(buf)

    def clear(self) -> None:
        """Drop the buffers (the writer is done); a later `take` makes new ones."""
        while not self._free.empty():
            self._free.get()
        self._made = 0


@dataclass
class _FileState:
    path: str
    out: RangeWriter
    next_offset: int  # for the running checksum: where the next in-order write must start
    hasher: object | None


def _close(st: _FileState) -> None:
    try:
        st.out.close()
    except OSError:
        pass


class OutputFiles:
    """One writer's open output files under `root`: positional writes (queued behind the caster with
    `write_behind`), checksummed in order, fsync'ed at close. `plan` names the files' layouts (their
    headers start the running checksums, their sizes the room a full disk needs); without one, or
    with `algo=None`, nothing is checksummed (the caller checks its files another way).
    `address(buf)`: where a staging buffer of `alloc` starts in memory; given (with `write_behind`),
    staged chunks are written around the page cache where the storage allows it."""

    def __init__(
        self,
        root: str,
        plan: layout.Plan | None,
        alloc: Callable[[int], object],
        chunk_bytes: int,
        progress: Progress | None = None,
        algo: str | None = DEFAULT_ALGO,
        fsync: bool = True,
        write_behind: bool = True,
        address: Callable[[object], int] | None = None,
    ) -> None:
        self.root, self.plan = root, plan
        self.progress = progress or (lambda n: None)
        self.algo = algo if plan is not None else None
        self.fsync = fsync  # False only for `slimckpt merge --no_fsync`: not durable across a power loss
        self.write_behind = write_behind
        self.address = address if write_behind else None
        # around the page cache: a buffer being cast and one per write thread
        ring = DIRECT_WRITERS + 1 if self.address is not None else PIPELINE_DEPTH
        self.ring = StagingRing(min(max(1, chunk_bytes), 1 << 30), alloc, ring)
        self._files: dict[str, _FileState] = {}
        self._behind: _WriteBehind | None = None
        self._pending_buf = None  # staging buffer of the last `stage`, until submitted
        self._pending_at: int | None = None  # the file offset the pending buffer was placed for
        self._layouts = {f.name: f for f in plan.files} if plan is not None else {}
        self._need = sum(f.size for f in plan.files) if plan is not None else None
        self.checksums: dict[str, str] = {}  # files written whole, in order, by this writer

    def _file(self, name: str) -> _FileState:
        st = self._files.get(name)
        if st is None:
            path = os.path.join(self.root, name)
            storage = for_path(path)
            try:
                out = storage.open_ranges_direct(path) if self.address is not None else storage.open_ranges(path)
            except OSError as exc:
                raise os_error(exc, path) from None
            if self.algo is None:
                st = self._files[name] = _FileState(path, out, 0, None)
            else:
                f = self._layouts[name]
                hasher = new_hasher(self.algo)
                hasher.update(f.header)
                st = self._files[name] = _FileState(path, out, f.data_start, hasher)
        return st

    def _account(self, st: _FileState, data: memoryview, offset: int) -> None:
        """The running checksum and the progress, in the caller's order of writes."""
        if st.hasher is not None:
            if offset == st.next_offset:
                st.hasher.update(data)
                st.next_offset += len(data)
            else:
                st.hasher = None  # not written in order by us alone: checksum by reading back
        self.progress(len(data))

    def _write_file(self, st: _FileState, data: memoryview, offset: int, direct: bool = False) -> None:
        pause("write")
        try:
            if direct:
                st.out.write_direct(data, offset)
            else:
                st.out.write(data, offset)
        except OSError as exc:
            raise os_error(exc, st.path, self._need) from None

    def write(self, file: str, data: memoryview, offset: int) -> None:
        """Write now, on this thread."""
        st = self._file(file)
        self._write_file(st, data, offset)
        self._account(st, data, offset)

    def stage(self, nbytes: int, at: int | None = None) -> object:
        """A staging buffer for the next chunk (at least nbytes); `submit` hands it back. `at`: the
        file offset the chunk goes to, where a writer around the page cache places it."""
        if self._pending_buf is not None:  # staged but never submitted (a check failed): reuse it
            self.ring.give_back(self._pending_buf)
        if self.address is None or at is None:
            self._pending_buf, self._pending_at = self.ring.take(nbytes), None
            return self._pending_buf
        buf = self.ring.take(max(nbytes, self.ring.min_bytes) + DIRECT_ALIGN)  # every buffer one size, reused
        shift = (at - self.address(buf)) % DIRECT_ALIGN
        self._pending_buf, self._pending_at = buf, at
        return buf[shift : shift + nbytes]

    def submit(self, file: str, data: memoryview, offset: int) -> None:
        """Queue a write; the staging buffer `data` may live in goes back to the ring once written."""
        buf, self._pending_buf = self._pending_buf, None
        direct, self._pending_at = buf is not None and self._pending_at == offset, None
        if not self.write_behind:
            try:
                self.write(file, data, offset)
            finally:
                if buf is not None:
                    self.ring.give_back(buf)
            return
        st = self._file(file)
        self._account(st, data, offset)
        if self._behind is None:
            threads = DIRECT_WRITERS if self.address is not None else 1
            self._behind = _WriteBehind(self._write_file, threads)
        done = None if buf is None else (lambda: self.ring.give_back(buf))
        # the queued item keeps `data` (and the buffer under it) alive until it is written
        self._behind.submit(st, data, offset, direct, done)

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
        if self._files:
            pause("close")
        for name, st in self._files.items():
            try:
                if self.fsync:
                    st.out.sync()
            except OSError as exc:
                errors.append(os_error(exc, st.path))
            finally:
                _close(st)
            if st.hasher is not None and st.next_offset == self._layouts[name].size:
                self.checksums[name] = st.hasher.hexdigest()
        self._files.clear()
        self.ring.clear()
        if errors:
            raise errors[0]

    def abort(self) -> None:
        """Close every file without fsync or checksums (the output is being discarded)."""
        self._stop_behind()
        for st in self._files.values():
            _close(st)
        self._files.clear()
        self.ring.clear()
