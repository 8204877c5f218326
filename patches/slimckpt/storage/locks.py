"""Advisory locks on checkpoint directories: one writer, or many readers, never retention under either.

A lock on `<parent>/<name>` is the storage's lease on a sibling key `<parent>/.<name>.slimckpt-lock`
(on a filesystem: `flock(2)` on that file, slimckpt.storage.posix):

    exclusive  a writer (a `slimckpt merge` into a target, a trainer saving a step) and retention
               while it deletes.
    shared     a reader (a load, a merge or export reading a step's shards).

The holder writes "pid P on host H: what" into the file, so the one refused can say who holds it.

Why a lease and a sibling file: the kernel drops a flock when its holder dies (SIGKILL included),
so a killed process never leaves a lock that blocks; a pid file would. The lock file lives next to
the directory, not in it, so it works for a target that does not exist yet (merge creates
`<target>.partial` only once it holds the lock) and never becomes part of a checkpoint or an
output dir. An exclusive holder removes the file when it releases. A reader that cannot create
the file (read-only parent) reads without a lock: nothing can delete that directory either.

All locks are non-blocking: a conflict raises LockBusy at once, with a one-line message naming
the directory, the holder and the fix. Advisory only: a process that does not use slimckpt does
not see them.
"""

from __future__ import annotations

import contextlib
import errno
import os
import socket
import time
from collections.abc import Iterator
from dataclasses import dataclass

from slimckpt import SlimckptError
from slimckpt.log import get_logger
from slimckpt.storage import Lease, absolute, for_path

log = get_logger("slimckpt.locks")

LOCK_SUFFIX = ".slimckpt-lock"


class LockBusy(SlimckptError, RuntimeError):
    """Another process holds a conflicting lock; str() is the one-line message."""

    def __init__(self, message: str, holder: str = "") -> None:
        super().__init__(message)
        self.holder = holder


def lock_file_for(path: str) -> str:
    """`<parent>/.<name>.slimckpt-lock` for the directory `path` (which may not exist yet)."""
    path = absolute(path).rstrip("/")  # a URL as it is (abspath would make s3://b/k a local path)
    return os.path.join(os.path.dirname(path), f".{os.path.basename(path)}{LOCK_SUFFIX}")


def describe_holder(lock_file: str) -> str:
    """What the exclusive holder wrote ("pid 123 on host h: merging"), or "" when unknown."""
    return for_path(lock_file).lease_note(lock_file)


@dataclass
class Lock:
    path: str  # the directory the lock is about
    lock_file: str
    exclusive: bool
    lease: Lease | None  # None: a reader without a lock (read-only parent)

    def release(self) -> None:
        lease, self.lease = self.lease, None
        if lease is not None:
            lease.release()

    def __enter__(self) -> Lock:
        return self

    def __exit__(self, *exc) -> None:
        self.release()


def _holder_note(what: str) -> str:
    return f"pid {os.getpid()} on host {socket.gethostname()}: {what} (since {time.strftime('%H:%M:%S')})\n"


def acquire(path: str, *, exclusive: bool, what: str, fix: str) -> Lock:
    """Lock the directory `path` now or raise LockBusy ("<path> is <holder>; <fix>").

    `what` says what this process does with it (shown to the one refused); `fix` what the refused
    one should do. A reader whose lock file cannot be created gets a Lock that holds nothing."""
    lock_file = lock_file_for(path)
    try:
        lease = for_path(lock_file).lease(lock_file, exclusive=exclusive)
    except OSError as exc:
        if not exclusive and exc.errno in (errno.EROFS, errno.EACCES, errno.EPERM):
            log.debug("reading %s without a lock (%s is not writable)", path, os.path.dirname(lock_file))
            return Lock(path, lock_file, exclusive, None)
        raise
    if lease is None:
        holder = describe_holder(lock_file)
        who = f"held by {holder}" if holder else "held by another process"
        raise LockBusy(f"slimckpt: {absolute(path)} is locked ({who}; lock {lock_file}); {fix}", holder)
    lease.note(_holder_note(what))  # a reader too: a stale note of a killed writer must not be shown
    return Lock(path, lock_file, exclusive, lease)


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
