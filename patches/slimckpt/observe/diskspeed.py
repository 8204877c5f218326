"""Sequential disk bandwidth of a directory's filesystem, measured the way checkpoints use it:
large writes ending in fsync, then a read of the same file with its pages evicted first.

Both ways to reach the disk are measured: through the page cache (what `torch.save`, verl's merger,
slimckpt's merge and plain `open()` use) and with O_DIRECT (past the page cache: what the disk
itself moves). They can differ by 4x either way, by host and by request size. The I/O floor of a
job uses the faster of the two, so it is what the disk can do, not what one path happens to get.
O_DIRECT is measured with two request sizes, for the same reason: a disk can move 1 MiB requests
faster than 16 MiB ones, and a floor from 16 MiB alone would then be too easy to come close to
(measured: BENCHMARKS.md, Figures quoted in the code).

`slimckpt diskspeed DIR` prints them (its arguments: slimckpt.observe.diskspeed_cli); the timed I/O
on the scratch file is slimckpt.storage.disk_probe's.
"""

from __future__ import annotations

import os
import statistics
import threading
import time
from dataclasses import dataclass, fields

from slimckpt.observe.measure import evict_from_page_cache
from slimckpt.storage import disk_probe

CHUNK = 16 * 2**20  # through the page cache (the kernel splits and reads ahead on its own)
DIRECT_CHUNKS = (2**20, 16 * 2**20)  # O_DIRECT: each measured, the faster kept


@dataclass
class DiskSpeed:
    write_bytes_per_s: float  # the faster path's (see the module docstring)
    read_bytes_per_s: float
    size_bytes: int
    buffered_write_bytes_per_s: float = 0.0
    buffered_read_bytes_per_s: float = 0.0
    direct_write_bytes_per_s: float = 0.0  # 0: the filesystem refuses O_DIRECT
    direct_read_bytes_per_s: float = 0.0
    mixed_bytes_per_s: float = 0.0  # O_DIRECT read of one file while writing half as much to another, combined

    def io_floor_s(self, read_bytes: int, written_bytes: int) -> float:
        """Seconds a job needs at best to read and write this much, one after the other."""
        return read_bytes / self.read_bytes_per_s + written_bytes / self.write_bytes_per_s

    def describe(self) -> str:
        gb = 1e9
        text = (
            f"write {self.write_bytes_per_s / gb:.2f} GB/s, read {self.read_bytes_per_s / gb:.2f} GB/s "
            f"(through the page cache: write {self.buffered_write_bytes_per_s / gb:.2f} (fsync'ed), "
            f"cold read {self.buffered_read_bytes_per_s / gb:.2f}"
        )
        if self.direct_write_bytes_per_s:
            text += (
                f"; O_DIRECT: write {self.direct_write_bytes_per_s / gb:.2f}, "
                f"read {self.direct_read_bytes_per_s / gb:.2f}"
            )
        if self.mixed_bytes_per_s:
            text += (
                f"; O_DIRECT reading and writing at once, as a merge does: {self.mixed_bytes_per_s / gb:.2f} combined"
            )
        return text + ")"


def fastest_of(speeds: list[DiskSpeed]) -> DiskSpeed:
    """Each bandwidth at its best over several measurements: on a disk whose speed drifts (a shared
    VM's), a floor from the fastest is the hardest one to come close to."""
    best = {f.name: max(getattr(s, f.name) for s in speeds) for f in fields(DiskSpeed) if f.name != "size_bytes"}
    return DiskSpeed(size_bytes=speeds[0].size_bytes, **best)


def _write(path: str, size: int, direct: bool, chunk: int = CHUNK) -> float:
    return disk_probe.timed_write(path, size, direct, chunk)


def _read(path: str, direct: bool, chunk: int = CHUNK) -> float:
    evict_from_page_cache([path])  # a cold read, as a resume or a merge reads a checkpoint
    return disk_probe.timed_read(path, direct, chunk)


def _mixed(read_path: str, write_path: str, size: int) -> float:
    """A merge's pattern: read `size` bytes (fp32 shards) while writing size/2 (bf16 output)."""
    if not os.path.exists(read_path):
        return 0.0
    results: list[float] = []
    writer = threading.Thread(target=lambda: results.append(_write(write_path, size // 2, True, DIRECT_CHUNKS[0])))
    start = time.perf_counter()
    writer.start()
    _read(read_path, True, DIRECT_CHUNKS[0])
    writer.join()
    elapsed = time.perf_counter() - start
    return (size + size // 2) / elapsed if results and results[0] else 0.0


def measure_disk_speed(directory: str, size_bytes: int = 1 * 2**30, repeats: int = 3) -> DiskSpeed:
    """Medians of `repeats` write+read rounds per path, each on a new file."""
    os.makedirs(directory, exist_ok=True)
    path = os.path.join(directory, ".slimckpt_diskspeed")
    other = path + ".2"
    results: dict[bool, tuple[list[float], list[float]]] = {False: ([], []), True: ([], [])}
    mixed: list[float] = []
    try:
        for _ in range(repeats):
            for direct in (False, True):
                w = r = 0.0
                for chunk in DIRECT_CHUNKS if direct else (CHUNK,):
                    w_chunk = _write(path, size_bytes, direct, chunk)
                    w = max(w, w_chunk)
                    r = max(r, _read(path, direct, chunk) if w_chunk else 0.0)
                results[direct][0].append(w)
                results[direct][1].append(r)
                if direct and w:
                    mixed.append(_mixed(path, other, size_bytes))
                disk_probe.remove_scratch(path, other)
    finally:
        disk_probe.remove_scratch(path, other)
    bw, br = (statistics.median(v) for v in results[False])
    dw, dr = (statistics.median(v) for v in results[True])
    return DiskSpeed(max(bw, dw), max(br, dr), size_bytes, bw, br, dw, dr, statistics.median(mixed) if mixed else 0.0)
