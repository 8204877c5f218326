"""Timed sequential I/O on a scratch file of the probe's own, as `slimckpt diskspeed` measures a disk:
large writes ending in fsync, reads from the first byte to the last, each through the page cache or
with O_DIRECT. Never a checkpoint's file: the caller names a scratch path and removes it here.

A filesystem that refuses O_DIRECT (tmpfs on older kernels, some network filesystems) gives 0.0 for
that path instead of an error: the path is then not measured.
"""

from __future__ import annotations

import errno
import mmap
import os
import time

_REFUSALS = (errno.EINVAL, errno.EOPNOTSUPP, errno.ENOTSUP)  # what a filesystem says to O_DIRECT it will not do


def _open(path: str, flags: int, direct: bool) -> int | None:
    if not direct:
        return os.open(path, flags, 0o644)
    if not hasattr(os, "O_DIRECT"):
        return None
    try:
        return os.open(path, flags | os.O_DIRECT, 0o644)
    except OSError as exc:
        if exc.errno in _REFUSALS:
            return None
        raise


def _buffer(nbytes: int) -> mmap.mmap:
    # anonymous memory is page-aligned, as O_DIRECT wants its buffers
    return mmap.mmap(-1, max(1, nbytes))


def timed_write(path: str, size: int, direct: bool, chunk: int) -> float:
    """Bytes per second writing `size` random bytes to `path` in `chunk`s, the fsync included; 0.0
    where `direct` and the filesystem refuses O_DIRECT."""
    block = _buffer(chunk)
    block[:] = os.urandom(chunk)
    start = time.perf_counter()
    fd = _open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, direct)
    if fd is None:
        return 0.0
    try:
        written = 0
        while written < size:
            written += os.pwrite(fd, block, written)
        os.fsync(fd)  # part of the timed write: a checkpoint is not written before it is on the disk
    finally:
        os.close(fd)
    return written / (time.perf_counter() - start)


def timed_read(path: str, direct: bool, chunk: int) -> float:
    """Bytes per second reading all of `path` in `chunk`s (evict its pages first for a cold read);
    0.0 where `direct` and the filesystem refuses O_DIRECT."""
    block = _buffer(chunk)
    start = time.perf_counter()
    fd = _open(path, os.O_RDONLY, direct)
    if fd is None:
        return 0.0
    total = 0
    try:
        while True:
            n = os.preadv(fd, [block], total)
            if n <= 0:
                break
            total += n
    finally:
        os.close(fd)
    return total / (time.perf_counter() - start)


def remove_scratch(*paths: str) -> None:
    for path in paths:
        if os.path.exists(path):
            os.remove(path)
