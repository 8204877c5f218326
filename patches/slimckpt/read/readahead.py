"""Ask the kernel to start reading the merge's source shards while Python is still importing.

A merge spends its first seconds importing torch and transformers (GIL-bound, no disk), then
reads every rank file once through mmap page faults. `posix_fadvise(WILLNEED)` queues those reads
up front, so by the time the writer touches a page it is usually in the page cache: the import
time hides the read time. Only page cache is used (never anonymous memory), capped at a fraction
of the memory the kernel reports available, so a 70B merge on a small host advises a prefix of its
shards and evicts nothing it would need.

No torch here: this runs before torch is imported.
"""

from __future__ import annotations

import os
import re
import threading

from .. import env_vars
from . import direct_io

RANK_FILE = re.compile(r"^model_world_size_\d+_rank_\d+\.pt$")
MEM_FRACTION = 0.25  # of MemAvailable


def available_bytes() -> int:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def plan(sizes: dict[str, int], budget: int) -> dict[str, int]:
    """Bytes to advise from the start of each file: all of them when they fit in `budget`, else the
    same share of every file (the writer walks the tensors in name order, which touches every rank
    file at once)."""
    total = sum(sizes.values())
    if total <= budget:
        return dict(sizes)
    if budget <= 0 or total <= 0:
        return {name: 0 for name in sizes}
    return {name: size * budget // total for name, size in sizes.items()}


def _advise(paths_and_lengths: list[tuple[str, int]]) -> None:
    for path, length in paths_and_lengths:
        if length <= 0:
            continue
        try:
            fd = os.open(path, os.O_RDONLY)
        except OSError:
            continue  # a missing or unreadable file is reported by the reader with a proper message
        try:
            os.posix_fadvise(fd, 0, length, os.POSIX_FADV_WILLNEED)
        except OSError:
            pass
        finally:
            os.close(fd)


def start(local_dir: str, fraction: float = MEM_FRACTION) -> threading.Thread | None:
    """Advise the model rank files of `local_dir` on a daemon thread (the syscall can block while it
    queues I/O); returns the thread, or None when there is nothing to do or no fadvise."""
    if not hasattr(os, "posix_fadvise") or not env_vars.flag("SLIMCKPT_READAHEAD"):
        return None
    try:
        names = sorted(n for n in os.listdir(local_dir) if RANK_FILE.match(n))
    except OSError:
        return None
    sizes = {}
    for name in names:
        try:
            sizes[name] = os.path.getsize(os.path.join(local_dir, name))
        except OSError:
            continue
    if direct_io.supported([os.path.join(local_dir, n) for n in sizes]):
        return None  # the writer reads them with O_DIRECT: filling the page cache would only compete
    lengths = plan(sizes, int(available_bytes() * fraction))
    work = [(os.path.join(local_dir, n), lengths[n]) for n in names if lengths.get(n)]
    if not work:
        return None
    thread = threading.Thread(target=_advise, args=(work,), name="slimckpt-readahead", daemon=True)
    thread.start()
    return thread
