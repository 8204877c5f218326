"""O_DIRECT primitives for the merge: open, aligned buffers, and the split of a write into the
parts that may bypass the page cache.

Why bypass it: a merge reads every shard byte once and writes every output byte once, so caching
them buys nothing, and on some hosts filling the page cache is the slowest part of the job. On the
development VM (ext4 on virtio) a cold buffered read ran at 0.35 GB/s and a buffered write into
new pages at 0.3 GB/s, while O_DIRECT reads ran at 1.1-1.9 GB/s and O_DIRECT writes at 1.3-2.3 GB/s
(`slimckpt diskspeed <dir>` measures both). A 70B merge through the page cache would also push everything
else on the host out of it.

O_DIRECT needs the file offset, the length and the memory address aligned to the device's logical
block. We align to ALIGN (4096 or the page size) and keep the
buffered path for the unaligned head and tail of a range, and for filesystems that refuse
O_DIRECT (tmpfs on older kernels, some network filesystems): `open_direct` returns None there and
callers use their buffered descriptor, and the first refusal in a process is logged at WARNING
(`page_cache_fallback`): the page cache costs real time (a 1B merge took 7.9 s instead of 4.2 s
in one bench run) and the user can do something about it (another filesystem for the output or
the shards). `SLIMCKPT_DIRECT_IO=0` turns O_DIRECT off, as a choice: nothing is logged then.
"""

from __future__ import annotations

# lazy imports: torch only for aligned_empty (the verify and plan commands read without torch)
import errno
import mmap
import os
import threading

from .. import env_vars
from ..log import get_logger

log = get_logger(__name__)

# a multiple of every common logical block size, and whole pages, so a buffered partial block
# never shares a page with a direct one
ALIGN = max(4096, os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096)
ENV = "SLIMCKPT_DIRECT_IO"
_REFUSALS = (errno.EINVAL, errno.EOPNOTSUPP, errno.ENOTSUP)  # what a filesystem says to O_DIRECT it will not do
_fallback_lock = threading.Lock()
_fallback_logged = False  # once per process: a merge opens hundreds of files on the same filesystem


def enabled() -> bool:
    return hasattr(os, "O_DIRECT") and env_vars.flag(ENV)


def align_down(n: int, align: int = ALIGN) -> int:
    return n - n % align


def align_up(n: int, align: int = ALIGN) -> int:
    return align_down(n + align - 1, align)


def split(offset: int, length: int, address: int, align: int = ALIGN) -> tuple[int, int, int]:
    """(head, body, tail) byte counts of a write of `length` bytes from memory `address` to file
    `offset`: the body may go through O_DIRECT (offset, address and length aligned), the head and
    tail may not. Everything is head when the address is not congruent to the offset."""
    if length <= 0:
        return 0, 0, 0
    if address % align != offset % align:
        return length, 0, 0
    head = min(length, align_up(offset, align) - offset)
    body = align_down(length - head, align)
    return head, body, length - head - body


def open_direct(path: str, flags: int) -> int | None:
    """An O_DIRECT descriptor of `path`, or None where the filesystem (or this switch) says no."""
    if not enabled():
        return None
    try:
        return os.open(path, flags | os.O_DIRECT)
    except OSError as exc:
        if refused(exc):
            page_cache_fallback(path, exc)
            return None
        raise


def page_cache_fallback(path: str, exc: OSError) -> None:
    """Say (once per process, at WARNING) that O_DIRECT was refused for `path` and its bytes go
    through the page cache. Not called when SLIMCKPT_DIRECT_IO=0 chose the page cache."""
    global _fallback_logged
    with _fallback_lock:
        if _fallback_logged:
            return
        _fallback_logged = True
    log.warning(
        "O_DIRECT refused for %s (%s): reading and writing through the page cache instead, which can "
        "be about twice as slow; put the checkpoint on a filesystem with O_DIRECT (ext4, xfs), or set "
        "%s=0 to choose the page cache without this warning (logged once per process)",
        path,
        exc.strerror or exc,
        ENV,
    )


def supported(paths: list[str]) -> bool:
    """Whether every one of `paths` opens with O_DIRECT (and it is switched on)."""
    if not paths:
        return False
    for path in paths:
        try:
            fd = open_direct(path, os.O_RDONLY)
        except OSError:
            return False  # the readers report a missing/unreadable file with a proper message
        if fd is None:
            return False
        os.close(fd)
    return True


def refused(exc: OSError) -> bool:
    """An O_DIRECT transfer the filesystem would not do (alignment stricter than ALIGN, say): the
    caller redoes it buffered. Anything else is a real I/O error."""
    return exc.errno in _REFUSALS


def aligned_buffer(nbytes: int) -> mmap.mmap:
    """Anonymous memory of `nbytes`, page-aligned (so ALIGN-aligned), without torch."""
    return mmap.mmap(-1, max(1, nbytes))


def aligned_empty(nbytes: int):
    """A uint8 CPU tensor of `nbytes` whose first byte sits on an ALIGN boundary."""
    import torch

    raw = torch.empty(nbytes + ALIGN, dtype=torch.uint8)
    skip = (-raw.data_ptr()) % ALIGN
    return raw[skip : skip + nbytes]
