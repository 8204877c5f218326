"""Advisory locks on checkpoint directories: one writer, or many readers, never retention under either.

A lock on `<parent>/<name>` is `flock(2)` on a sibling file `<parent>/.<name>.slimckpt-lock`:

    exclusive  a writer (a `slimckpt merge` into a target, a trainer saving a step) and retention
               while it deletes.
    shared     a reader (a load, a merge or export reading a step's shards).

The holder writes "pid P on host H: what" into the file, so the one refused can say who holds it.

Why flock and a sibling file: the kernel drops a flock when its holder dies (SIGKILL included), so
a killed process never leaves a lock that blocks; a pid file would. The lock file lives next to the
directory, not in it, so it works for a target that does not exist yet (merge creates
`<target>.partial` only once it holds the lock) and never becomes part of a checkpoint or an
output dir. An exclusive holder removes the file when it releases; an opener checks after
`flock` that the path still names the inode it locked (else it retries), so removing it is safe.
A reader that cannot create the file (read-only parent) reads without a lock: nothing can delete
that directory either.

All locks are non-blocking: a conflict raises LockBusy at once, with a one-line message naming
the directory, the holder and the fix. Advisory only: a process that does not use slimckpt does
not see them; on NFS flock is emulated with byte-range locks (Linux >= 2.6.12), which work.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import socket
import time
from collections.abc import Iterator
from dataclasses import dataclass

from .. import SlimckptError
from ..log import get_logger

log = get_logger("slimckpt.locks")

LOCK_SUFFIX = ".slimckpt-lock"


class LockBusy(SlimckptError, RuntimeError):
    """Another process holds a conflicting lock; str() is the one-line message."""

    def __init__(self, message: str, holder: str = "") -> None:
        super().__init__(message)
        self.holder = holder


def lock_file_for(path: str) -> str:
    """`<parent>/.<name>.slimckpt-lock` for the directory `path` (which may not exist yet)."""
    path = os.path.abspath(path).rstrip(os.sep)
    return os.path.join(os.path.dirname(path), f".{os.path.basename(path)}{LOCK_SUFFIX}")


def describe_holder(lock_file: str) -> str:
    """What the exclusive holder wrote ("pid 123 on host h: merging"), or "" when unknown."""
    try:
        with open(lock_file, encoding="utf-8") as f:
            return f.read(400).strip().splitlines()[0] if f else ""
    except (OSError, IndexError, UnicodeDecodeError):
        return ""


@dataclass
class Lock:
    path: str  # the directory the lock is about
    lock_file: str
    exclusive: bool
    fd: int | None

    def release(self) -> None:
        fd, self.fd = self.fd, None
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
                if os.fstat(fd).st_ino == os.stat(self.lock_file).st_ino:
                    os.unlink(self.lock_file)
        finally:
            os.close(fd)

    def __enter__(self) -> Lock:
        return self

    def __exit__(self, *exc) -> None:
        self.release()


def _open_locked(lock_file: str, exclusive: bool) -> int | None:
    """An fd holding the flock on `lock_file`, or None when someone else holds a conflicting one.
    Raises OSError when the file cannot be created (read-only or unwritable parent)."""
    mode = fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH
    for _ in range(100):
        fd = os.open(lock_file, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        try:
            fcntl.flock(fd, mode | fcntl.LOCK_NB)
        except OSError as exc:
            os.close(fd)
            if exc.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                return None
            raise
        try:
            same = os.fstat(fd).st_ino == os.stat(lock_file).st_ino
        except FileNotFoundError:
            same = False
        if same:
            return fd
        os.close(fd)  # the previous holder removed the file between our open and flock: retry
    raise OSError(errno.EAGAIN, "lock file keeps being replaced", lock_file)


def _note_holder(fd: int, what: str) -> None:
    text = f"pid {os.getpid()} on host {socket.gethostname()}: {what} (since {time.strftime('%H:%M:%S')})\n"
    with contextlib.suppress(OSError):
        os.ftruncate(fd, 0)
        os.pwrite(fd, text.encode(), 0)


def acquire(path: str, *, exclusive: bool, what: str, fix: str) -> Lock:
    """Lock the directory `path` now or raise LockBusy ("<path> is <holder>; <fix>").

    `what` says what this process does with it (shown to the one refused); `fix` what the refused
    one should do. A reader whose lock file cannot be created gets a Lock that holds nothing."""
    lock_file = lock_file_for(path)
    try:
        fd = _open_locked(lock_file, exclusive)
    except OSError as exc:
        if not exclusive and exc.errno in (errno.EROFS, errno.EACCES, errno.EPERM):
            log.debug("reading %s without a lock (%s is not writable)", path, os.path.dirname(lock_file))
            return Lock(path, lock_file, exclusive, None)
        raise
    if fd is None:
        holder = describe_holder(lock_file)
        who = f"held by {holder}" if holder else "held by another process"
        raise LockBusy(f"slimckpt: {os.path.abspath(path)} is locked ({who}; lock {lock_file}); {fix}", holder)
    _note_holder(fd, what)  # a reader too: a stale note of a killed writer must not be shown
    return Lock(path, lock_file, exclusive, fd)


def try_exclusive(path: str, what: str) -> Lock | None:
    """The exclusive lock on `path`, or None when a reader or writer holds it (retention skips)."""
    try:
        return acquire(path, exclusive=True, what=what, fix="")
    except LockBusy:
        return None


@contextlib.contextmanager
def reading(path: str, what: str) -> Iterator[Lock]:
    """Shared lock for the duration of a read: retention will not delete `path` meanwhile."""
    lock = acquire(path, exclusive=False, what=what, fix="wait until it is written (or deleted) and retry")
    try:
        yield lock
    finally:
        lock.release()


def reading_if_dir(path: str | None, what: str):
    """`reading(path)` when `path` is an existing directory, else nothing (verl's hdfs or empty paths)."""
    if path and os.path.isdir(path):
        return reading(path, what)
    return contextlib.nullcontext()


@contextlib.contextmanager
def writing(path: str, what: str, fix: str) -> Iterator[Lock]:
    """Exclusive lock for the duration of a write; a second writer fails at once with `fix`."""
    lock = acquire(path, exclusive=True, what=what, fix=fix)
    try:
        yield lock
    finally:
        lock.release()


__all__ = [
    "LOCK_SUFFIX",
    "Lock",
    "LockBusy",
    "acquire",
    "describe_holder",
    "lock_file_for",
    "reading",
    "reading_if_dir",
    "try_exclusive",
    "writing",
]
