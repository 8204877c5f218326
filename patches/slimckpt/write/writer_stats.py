"""Where a merge's writer spent its time: whether the disk or the CPU bounds a merge.

The writer reads the rank files on one thread and casts and writes on others. If its read thread
is inside `preadv` for nearly all of the writer's time, and rarely waits for a free buffer, the
disk's reads bound the merge (the writes compete with them on the same disk); if the read thread
waits for buffers, the cast or the writes do. `slimckpt merge` (one writer: `--workers 1`, the
default) records this when `SLIMCKPT_MERGE_STATS=FILE` is set (the benchmark sets it) and writes
it to FILE as JSON.

No torch here.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass

from .. import env_vars

STATS_ENV = "SLIMCKPT_MERGE_STATS"


@dataclass
class WriterStats:
    wall_s: float = 0.0  # the writer's whole share, fsync included
    read_bytes: int = 0  # tensor bytes the read threads delivered
    read_s: float = 0.0  # read threads inside preadv, summed over threads
    read_threads: int = 0
    wait_buffer_s: float = 0.0  # read threads waiting for the caster to hand back a buffer
    wait_read_s: float = 0.0  # the caster waiting for a read to finish
    cast_s: float = 0.0  # the caster casting (and comparing rank copies)
    close_s: float = 0.0  # the last writes and the fsyncs, after the last chunk was handed over

    def read_busy(self) -> float:
        """Share of the writer's time its read threads spent inside preadv (per thread)."""
        if self.wall_s <= 0 or self.read_threads <= 0:
            return 0.0
        return self.read_s / self.read_threads / self.wall_s

    def save(self, path: str) -> None:
        tmp = f"{path}.tmp{os.getpid()}"
        with open(tmp, "w", encoding="utf-8") as f:
            json.dump(asdict(self), f)
        os.replace(tmp, path)

    @classmethod
    def load(cls, path: str) -> WriterStats:
        with open(path, encoding="utf-8") as f:
            return cls(**json.load(f))


def requested_path() -> str | None:
    """FILE of SLIMCKPT_MERGE_STATS=FILE, or None when not asked for."""
    return env_vars.path(STATS_ENV)
