"""Sequential disk bandwidth of a directory's filesystem, measured the way checkpoints use it:
large writes ending in fsync, then a read of the same file with its pages evicted first."""

from __future__ import annotations

import os
import time
from dataclasses import dataclass

from .measure import evict_from_page_cache

CHUNK = 16 * 2**20


@dataclass
class DiskSpeed:
    write_bytes_per_s: float
    read_bytes_per_s: float
    size_bytes: int

    def io_floor_s(self, read_bytes: int, written_bytes: int) -> float:
        """Seconds a job needs at best to read and write this much, one after the other."""
        return read_bytes / self.read_bytes_per_s + written_bytes / self.write_bytes_per_s


def measure_disk_speed(directory: str, size_bytes: int = 1 * 2**30) -> DiskSpeed:
    os.makedirs(directory, exist_ok=True)
    path = os.path.join(directory, ".slimckpt_diskspeed")
    block = os.urandom(CHUNK)
    try:
        start = time.perf_counter()
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            written = 0
            while written < size_bytes:
                written += os.write(fd, block)
            os.fsync(fd)
        finally:
            os.close(fd)
        write_s = time.perf_counter() - start
        evict_from_page_cache([path])
        start = time.perf_counter()
        fd = os.open(path, os.O_RDONLY)
        try:
            while os.read(fd, CHUNK):
                pass
        finally:
            os.close(fd)
        read_s = time.perf_counter() - start
        return DiskSpeed(written / write_s, written / read_s, written)
    finally:
        try:
            os.remove(path)
        except FileNotFoundError:
            pass
