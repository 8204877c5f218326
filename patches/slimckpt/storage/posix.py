"""`Storage` on a POSIX filesystem (local disk, NFS, Lustre...): what slimckpt always did.

ranges    a file made at its final size (`posix_fallocate`, or a sparse `ftruncate` where the
          filesystem has no fallocate), then `pwrite`s at their offsets, fsync at the end; a
          merge's large ranges go around the page cache (O_DIRECT) where the filesystem takes it.
atomic    a temporary file, fsync, `rename(2)` over the old one, fsync of the directory.
publish   `rename(2)` of the partial directory (an old one renamed aside first, back on failure).
leases    `flock(2)` on the key, a sibling file of the directory it is about. The kernel drops a
          flock when its holder dies (SIGKILL included), so a killed process never leaves a
          lock that blocks. An exclusive holder removes the file when it releases; an opener
          checks after `flock` that the path still names the inode it locked (else it
          retries), so removing it is safe. On NFS flock is emulated with byte-range locks
          (Linux >= 2.6.12), which work.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import shutil
import stat
from collections.abc import Iterator
from typing import IO

from slimckpt.storage.base import DIRECT_ALIGN, Lease, RangeWriter, Storage

NO_FALLOCATE = (errno.EOPNOTSUPP, errno.EINVAL, errno.ENOSYS)
# link(2) refused by the filesystem itself (FAT, some FUSE and SMB mounts): put_if_absent checks, then renames
NO_HARD_LINKS = (errno.EPERM, errno.EOPNOTSUPP, errno.ENOSYS, errno.EXDEV)
BUSY = (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES)


def reserve(fd: int, size: int) -> None:
    """The file at `size` bytes, its blocks allocated where the filesystem can."""
    try:
        os.posix_fallocate(fd, 0, size)
    except OSError as exc:
        if exc.errno not in NO_FALLOCATE:
            raise
        os.ftruncate(fd, size)  # filesystems without fallocate (some network ones): sparse file


def pwrite_all(fd: int, data: memoryview | bytes, offset: int) -> None:
    data = memoryview(data)
    while len(data):
        n = os.pwrite(fd, data, offset)
        if n <= 0:
            raise OSError(errno.EIO, "short write")
        data, offset = data[n:], offset + n


class PosixRangeWriter(RangeWriter):
    """`direct_fd`: the same file opened with O_DIRECT. `write_direct` sends the whole aligned blocks
    of a range through it and the few bytes before the first and after the last block boundary
    through `fd` (the page cache): no page is written both ways, so the two never disagree, also
    when several processes write neighbouring ranges of one file."""

    def __init__(self, path: str, fd: int, direct_fd: int | None = None) -> None:
        self.path, self.fd, self.direct_fd = path, fd, direct_fd

    def write(self, data: memoryview | bytes, offset: int) -> None:
        pwrite_all(self.fd, data, offset)

    def write_direct(self, data: memoryview | bytes, offset: int) -> None:
        data = memoryview(data)
        a = -(-offset // DIRECT_ALIGN) * DIRECT_ALIGN - offset  # bytes before the first block boundary
        b = (offset + len(data)) // DIRECT_ALIGN * DIRECT_ALIGN - offset  # ... up to the last one
        if self.direct_fd is None or b - a <= 0:
            pwrite_all(self.fd, data, offset)
            return
        if a:
            pwrite_all(self.fd, data[:a], offset)
        try:
            pwrite_all(self.direct_fd, data[a:b], offset + a)
        except OSError as exc:
            if exc.errno != errno.EINVAL:
                raise
            # the filesystem wants another alignment than it said it takes: the page cache from now on
            os.close(self.direct_fd)
            self.direct_fd = None
            pwrite_all(self.fd, data[a:b], offset + a)
        if b < len(data):
            pwrite_all(self.fd, data[b:], offset + b)

    def sync(self) -> None:
        os.fsync(self.fd)

    def close(self) -> None:
        fd, self.direct_fd = self.direct_fd, None
        if fd is not None:
            os.close(fd)
        os.close(self.fd)


def open_direct(path: str) -> int | None:
    """`path` opened for writing with O_DIRECT, or None where the filesystem refuses it (tmpfs, some
    network and FUSE mounts) or the platform has no O_DIRECT."""
    flag = getattr(os, "O_DIRECT", 0)
    if not flag:
        return None
    try:
        return os.open(path, os.O_WRONLY | flag)
    except OSError as exc:
        if exc.errno in (errno.EINVAL, errno.EOPNOTSUPP):
            return None
        raise


class PosixLease(Lease):
    def __init__(self, key: str, fd: int, exclusive: bool) -> None:
        self.key, self.exclusive = key, exclusive
        self._fd: int | None = fd

    def note(self, text: str) -> None:
        if self._fd is None:
            return
        with contextlib.suppress(OSError):
            os.ftruncate(self._fd, 0)
            os.pwrite(self._fd, text.encode(), 0)

    def release(self) -> None:
        fd, self._fd = self._fd, None
        if fd is None:
            return
        try:
            if not self.exclusive:
                # the last reader out removes the file if nobody else holds it
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                except OSError:
                    return
            with contextlib.suppress(OSError):
                if os.fstat(fd).st_ino == os.stat(self.key).st_ino:
                    os.unlink(self.key)
        finally:
            os.close(fd)


def _unlink_quietly(path: str) -> None:
    with contextlib.suppress(OSError):
        os.unlink(path)


class PosixStorage(Storage):
    supports_inplace_writes = True
    supports_dir_rename = True
    supports_leases_that_die_with_holder = True
    is_local = True

    # ------------------------------------------------------------------ room

    def free_bytes(self, path: str) -> int:
        return shutil.disk_usage(path).free

    def used_bytes(self, path: str) -> int:
        total = 0
        for root, _dirs, files in os.walk(path):
            for name in files:
                with contextlib.suppress(OSError):
                    total += os.lstat(os.path.join(root, name)).st_blocks * 512
        return total

    # ------------------------------------------------------------------ leases

    def lease(self, key: str, *, exclusive: bool) -> PosixLease | None:
        mode = fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH
        for _ in range(100):
            fd = os.open(key, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
            try:
                fcntl.flock(fd, mode | fcntl.LOCK_NB)
            except OSError as exc:
                os.close(fd)
                if exc.errno in BUSY:
                    return None
                raise
            try:
                same = os.fstat(fd).st_ino == os.stat(key).st_ino
            except FileNotFoundError:
                same = False
            if same:
                return PosixLease(key, fd, exclusive)
            os.close(fd)  # the previous holder removed the file between our open and flock: retry
        raise OSError(errno.EAGAIN, "lock file keeps being replaced", key)

    def lease_note(self, key: str) -> str:
        try:
            with open(key, encoding="utf-8") as f:
                return f.read(400).strip().splitlines()[0]
        except (OSError, IndexError, UnicodeDecodeError):
            return ""

    # ------------------------------------------------------------------ directories

    def make_dirs(self, path: str, *, exist_ok: bool = False) -> None:
        os.makedirs(path, exist_ok=exist_ok)

    # ------------------------------------------------------------------ writes

    def create_ranges(self, path: str, size: int, *, sparse: bool = False) -> PosixRangeWriter:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            if sparse:
                os.ftruncate(fd, size)
            else:
                reserve(fd, size)
        except BaseException:
            os.close(fd)
            raise
        return PosixRangeWriter(path, fd)

    def open_ranges(self, path: str) -> PosixRangeWriter:
        return PosixRangeWriter(path, os.open(path, os.O_WRONLY))

    def open_ranges_direct(self, path: str) -> PosixRangeWriter:
        fd = os.open(path, os.O_WRONLY)
        try:
            return PosixRangeWriter(path, fd, open_direct(path))
        except BaseException:
            os.close(fd)
            raise

    @contextlib.contextmanager
    def open_atomic(
        self, path: str, *, tmp: str | None = None, sync: bool = True, sync_dir: bool = True
    ) -> Iterator[IO[bytes]]:
        tmp = tmp or f"{path}.tmp.{os.getpid()}"
        try:
            with open(tmp, "wb") as f:
                yield f
                f.flush()
                if sync:
                    os.fsync(f.fileno())
            os.replace(tmp, path)
        except BaseException:
            _unlink_quietly(tmp)
            raise
        if sync_dir:
            self.sync(os.path.dirname(os.path.abspath(path)))

    def put_if_absent(self, path: str, data: bytes, *, tmp: str | None = None) -> bool:
        tmp = tmp or f"{path}.tmp.{os.getpid()}"
        try:
            with open(tmp, "wb") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
            try:
                os.link(tmp, path)  # fails with EEXIST, in one step, when a record is there
            except FileExistsError:
                return False
            except OSError as exc:
                if exc.errno not in NO_HARD_LINKS:
                    raise
                if os.path.lexists(path):
                    return False
                os.replace(tmp, path)
        finally:
            _unlink_quietly(tmp)
        self.sync(os.path.dirname(os.path.abspath(path)))
        return True

    @contextlib.contextmanager
    def open_stream(self, path: str) -> Iterator[IO[bytes]]:
        with open(path, "wb") as f:
            yield f
            f.flush()
            os.fsync(f.fileno())

    def sync_open(self, f: int | IO) -> None:
        os.fsync(f if isinstance(f, int) else f.fileno())

    # ------------------------------------------------------------------ durability

    def sync(self, path: str) -> None:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)

    def sync_tree(self, root: str) -> None:
        for dirpath, _dirs, names in os.walk(root):
            for name in names:
                self.sync(os.path.join(dirpath, name))
            self.sync(dirpath)

    # ------------------------------------------------------------------ publish

    def atomic_publish(self, partial: str, final: str, *, aside: str | None = None, durable: bool = True) -> None:
        moved = False
        try:
            if aside is not None and os.path.lexists(final):
                os.replace(final, aside)
                moved = True
            # rename(2) replaces an empty directory in one step
            os.replace(partial, final)
        except OSError:
            if moved and not os.path.exists(final):
                os.replace(aside, final)
            raise
        if durable:
            self.sync(os.path.dirname(os.path.abspath(final)))

    def replace(self, src: str, dst: str) -> None:
        os.replace(src, dst)

    # ------------------------------------------------------------------ deletes

    def remove(self, path: str) -> None:
        os.remove(path)

    def remove_tree(self, path: str, *, ignore_errors: bool = False) -> list[str]:
        if not ignore_errors:
            shutil.rmtree(path)
            return []
        errors: list[str] = []
        shutil.rmtree(path, onerror=lambda _f, p, e: errors.append(f"{p}: {e[1]}"))
        return errors

    # ------------------------------------------------------------------ reads

    def exists(self, path: str) -> bool:
        return os.path.exists(path)

    def is_dir(self, path: str) -> bool:
        return os.path.isdir(path)

    def size(self, path: str) -> int:
        st = os.stat(path)
        if stat.S_ISDIR(st.st_mode):
            raise IsADirectoryError(errno.EISDIR, os.strerror(errno.EISDIR), path)
        return st.st_size

    def list_dir(self, path: str) -> list[str]:
        return sorted(os.listdir(path))

    def open_read(self, path: str) -> contextlib.AbstractContextManager[IO[bytes]]:
        return open(path, "rb", buffering=0)  # readers read large chunks (checksums) or whole small files

    def list_files(self, root: str) -> list[str]:
        out = []
        for dirpath, _dirs, names in os.walk(root):
            for name in names:
                out.append(os.path.relpath(os.path.join(dirpath, name), root).replace(os.sep, "/"))
        return sorted(out)

    def read_range(self, path: str, offset: int, length: int) -> bytes:
        parts = []
        with open(path, "rb", buffering=0) as f:
            while length > 0:
                part = os.pread(f.fileno(), length, offset)
                if not part:
                    break
                parts.append(part)
                offset, length = offset + len(part), length - len(part)
        return b"".join(parts)


__all__ = ["PosixLease", "PosixRangeWriter", "PosixStorage", "pwrite_all", "reserve"]
