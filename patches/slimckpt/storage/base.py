"""`Storage`: what slimckpt does to checkpoint files, one named method per step.

Every wing that writes, commits, locks or deletes checkpoint files asks `storage.for_path(path)`
for the backend of that path and calls it; none calls the OS for it. A backend also says what
its medium can do (the `supports_*` properties), so that each choice a medium without POSIX's
guarantees must make (an object store: no write at an offset of an existing object, no lock, no
rename of a directory, no replace of one object by another in one step) is one method to
implement, not a search through the package.

A backend should expect these calls, in this order, for one output written (a trainer's step, a
merge's output, a converted step):

    1) free_bytes(dir), used_bytes(stale)  before anything: refuse an output its medium cannot hold
    2) lease(key, exclusive=True)          the writer's lease on the output (a reader takes a shared
                                           one); Lease.note(who) says who holds it
    3) remove_tree(partial), make_dirs()   what an earlier, killed attempt left; a fresh dir
    4) create_ranges(path, size)           (coordinator) each large file at its final size, with its
                                           header; open_ranges(path) (every writer) the same file
                                           again: RangeWriter.write(data, offset) of its own ranges,
                                           then RangeWriter.sync() and close()
       open_atomic(path) / put_atomic()    a small file (config, extra state, a note), whole or not
                                           at all; sync_open(f) for one written through open()
    5) sync(path), sync_tree(partial)      what was written and its directory entries, durable
    6) put_if_absent(manifest)             the record that commits, LAST, never over a committed one
    7) atomic_publish(partial, final)      the finished dir in place in one step, an old one set aside
    8) remove_tree(aside)                  the old one; later retention's remove_tree of old steps,
                                           remove(path) of single files (uncommit: the manifest first)
    9) Lease.release()

A writer of a stream of unknown length (DCP's rank files): open_stream(path), written in order;
`path` exists only once the block ends without an error (an object store completes its multipart
upload then, and aborts it on an error; abort_uploads(prefix) drops what a killed writer left).

A reader: lease(key, exclusive=False), exists/is_dir/size, list_dir/list_files(dir),
open_read(path) or read_range(path, offset, length), release. `is_local`: a path of this medium
is a file the OS can open and map (the merge maps local shards; a remote one is fetched first).

Errors are the medium's OSError, unchanged: the caller, which knows what the user ran, turns it
into its one line (format.os_errors).
"""

from __future__ import annotations

import contextlib
from abc import ABC, abstractmethod
from typing import IO

# Memory address and file offset alignment of a write around the page cache (O_DIRECT): 4 KiB
# covers both the 512-byte and the 4 KiB logical blocks of the disks and filesystems in use.
DIRECT_ALIGN = 4096


class RangeWriter(ABC):
    """One open file of known size, written at offsets (possibly by several writers at once)."""

    path: str

    @abstractmethod
    def write(self, data: memoryview | bytes, offset: int) -> None:
        """All of `data` at `offset` (a short write is retried, an empty one raises OSError)."""

    def write_direct(self, data: memoryview | bytes, offset: int) -> None:
        """As `write`, around the page cache where the medium allows it: `data`'s address must be
        congruent to `offset` modulo `DIRECT_ALIGN` (`OutputFiles.stage` places its buffers so)."""
        self.write(data, offset)

    @abstractmethod
    def sync(self) -> None:
        """What this writer wrote, durable."""

    @abstractmethod
    def close(self) -> None:
        """Release the file (no sync: call `sync` first for durability)."""


class Lease(ABC):
    """A held lock on a key: exclusive (one writer) or shared (readers); dropped when its holder dies."""

    key: str
    exclusive: bool

    @abstractmethod
    def note(self, text: str) -> None:
        """Say who holds it (best effort): what `Storage.lease_note` shows the one refused."""

    @abstractmethod
    def release(self) -> None:
        """Give it up (idempotent); the last holder out removes the key."""


class Storage(ABC):
    """The medium checkpoint files live on. See the module docstring for the order of the calls."""

    # ------------------------------------------------------------------ what the medium can do

    @property
    @abstractmethod
    def supports_inplace_writes(self) -> bool:
        """Several writers may write ranges of one file at its final size (POSIX pwrite). Without
        it a writer's ranges must become parts of the file assembled at close."""

    @property
    @abstractmethod
    def supports_dir_rename(self) -> bool:
        """`atomic_publish` is one rename of a directory. Without it an output is written in its
        final place and committed by its manifest alone (`put_if_absent`)."""

    @property
    @abstractmethod
    def supports_leases_that_die_with_holder(self) -> bool:
        """A lease is dropped by the kernel when its holder dies (flock). Without it a lease needs
        an expiry renewed by its holder."""

    @property
    def is_local(self) -> bool:
        """A path is a file the OS opens (open(), mmap) as it is."""
        return False

    def check_access(self, path: str) -> None:
        """Raise, in one line naming `path` and the fix, when `path` cannot be reached (a remote
        medium: endpoint, credentials, bucket, permission) before anything is written; a local
        path is reported by its first real use."""
        return None

    # ------------------------------------------------------------------ 1) room

    @abstractmethod
    def free_bytes(self, path: str) -> int:
        """Bytes free on the medium holding `path` (an existing directory)."""

    @abstractmethod
    def used_bytes(self, path: str) -> int:
        """Bytes the medium holds for everything under `path` (not the sizes: a file made at its
        final size holds only what was written); 0 when it does not exist."""

    # ------------------------------------------------------------------ 2) leases

    @abstractmethod
    def lease(self, key: str, *, exclusive: bool) -> Lease | None:
        """The lease on `key` now, or None when another holder's conflicts (never waits). Raises
        OSError when the key cannot be created (a read-only medium)."""

    @abstractmethod
    def lease_note(self, key: str) -> str:
        """The first line its holder noted, or "" when unknown."""

    # ------------------------------------------------------------------ 3) directories

    @abstractmethod
    def make_dirs(self, path: str, *, exist_ok: bool = False) -> None:
        """A directory and its missing parents."""

    # ------------------------------------------------------------------ 4) writes

    @abstractmethod
    def create_ranges(self, path: str, size: int, *, sparse: bool = False) -> RangeWriter:
        """A new file (an old one is truncated) at its final `size`, space reserved where the
        medium can, open for ranged writes. `sparse`: no space reserved, what is never written
        takes none (a scratch mirror that keeps some ranges of a file)."""

    @abstractmethod
    def open_ranges(self, path: str) -> RangeWriter:
        """An existing file (made by `create_ranges`), open for ranged writes."""

    def open_ranges_direct(self, path: str) -> RangeWriter:
        """As `open_ranges`, for a writer of large aligned ranges (the merge) whose `write_direct`
        bypasses the page cache where the medium allows it; elsewhere the same writer."""
        return self.open_ranges(path)

    @abstractmethod
    def open_atomic(
        self, path: str, *, tmp: str | None = None, sync: bool = True, sync_dir: bool = True
    ) -> contextlib.AbstractContextManager[IO[bytes]]:
        """A binary file to write whole; `path` becomes it when the block ends without an error
        (a reader sees the old file or the whole new one), and nothing is left when it fails.
        `tmp`: where it is written first; `sync`: made durable before it replaces `path`;
        `sync_dir`: the new entry made durable too."""

    def put_atomic(
        self, path: str, data: bytes, *, tmp: str | None = None, sync: bool = True, sync_dir: bool = True
    ) -> None:
        """`data` as the whole of `path`, as `open_atomic` writes it."""
        with self.open_atomic(path, tmp=tmp, sync=sync, sync_dir=sync_dir) as f:
            f.write(data)

    @abstractmethod
    def put_if_absent(self, path: str, data: bytes, *, tmp: str | None = None) -> bool:
        """`data` as the whole of `path` (durable, with its entry) only if `path` does not exist;
        False, and nothing written, when it does. For a record that commits: a committed one is
        never overwritten."""

    @abstractmethod
    def open_stream(self, path: str) -> contextlib.AbstractContextManager[IO[bytes]]:
        """A binary file written in order, of a length not known up front (large: a rank file).
        `path` holds all of it once the block ends without an error (durable); on an error it
        holds nothing of this write (POSIX: what was written so far stays until the step is
        cleared; the manifest, never written, keeps it out of every reader's sight)."""

    def abort_uploads(self, prefix: str) -> int:
        """Unfinished writes of a killed writer under `prefix` dropped; how many (0 where the
        medium has no such thing)."""
        return 0

    @abstractmethod
    def sync_open(self, f: int | IO) -> None:
        """What was written through an open file (a descriptor or a file object), durable."""

    # ------------------------------------------------------------------ 5) durability

    @abstractmethod
    def sync(self, path: str) -> None:
        """A file's contents, or a directory's entries, durable."""

    @abstractmethod
    def sync_tree(self, root: str) -> None:
        """Every file and directory under `root` (and `root`), durable."""

    # ------------------------------------------------------------------ 7) publish

    @abstractmethod
    def atomic_publish(self, partial: str, final: str, *, aside: str | None = None, durable: bool = True) -> None:
        """The finished directory `partial` becomes `final` in one step. An existing `final` goes
        to `aside` first (the caller removes it later) and comes back if the step fails; without
        `aside` only an empty `final` may be replaced. `durable`: the parent's entries made
        durable after (False: the caller syncs once after further steps)."""

    @abstractmethod
    def replace(self, src: str, dst: str) -> None:
        """`src` (a file) takes the place of `dst` in one step, where the medium can."""

    # ------------------------------------------------------------------ 8) deletes

    @abstractmethod
    def remove(self, path: str) -> None:
        """One file (FileNotFoundError when there is none)."""

    @abstractmethod
    def remove_tree(self, path: str, *, ignore_errors: bool = False) -> list[str]:
        """A directory and everything under it. `ignore_errors`: go on past what cannot be
        removed (a missing `path` included) and return one "path: error" line for each."""

    # ------------------------------------------------------------------ reads

    @abstractmethod
    def exists(self, path: str) -> bool:
        """A file or a directory is at `path`."""

    @abstractmethod
    def is_dir(self, path: str) -> bool:
        """`path` is a directory (on an object store: some object's key starts with `path/`)."""

    @abstractmethod
    def size(self, path: str) -> int:
        """Bytes of the file `path` (FileNotFoundError when there is none)."""

    @abstractmethod
    def list_dir(self, path: str) -> list[str]:
        """Names directly under the directory `path` (files and directories), sorted;
        FileNotFoundError when there is none."""

    @abstractmethod
    def open_read(self, path: str) -> contextlib.AbstractContextManager[IO[bytes]]:
        """The file `path`, open for reading (read, readinto, seek, tell); FileNotFoundError when
        there is none."""

    @abstractmethod
    def list_files(self, root: str) -> list[str]:
        """Relative, "/"-separated paths of every file under `root`, sorted."""

    @abstractmethod
    def read_range(self, path: str, offset: int, length: int) -> bytes:
        """`length` bytes of `path` from `offset` (fewer only at the end of the file)."""


__all__ = ["Lease", "RangeWriter", "Storage"]
