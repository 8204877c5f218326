"""Where a merge's writer spent its time: whether the casts (the CPU, and the reads, which happen
as page faults inside them) or the writes and fsyncs bound a merge.

The writer casts each chunk from the memory-mapped rank files on its own thread while write-behind
threads write the ones before. `slimckpt merge` (one writer: `--workers 1`, the default) records
this when `SLIMCKPT_MERGE_STATS=FILE` is set (the benchmark sets it) and writes it to FILE as JSON.

No torch here.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, fields
from typing import Any

from slimckpt import env_vars
from slimckpt.storage import for_path

STATS_ENV = "SLIMCKPT_MERGE_STATS"


@dataclass
class WriterStats:
    wall_s: float = 0.0  # the writer's whole share, fsync included
    cast_s: float = 0.0  # the caster casting (and comparing rank copies); the reads are its page faults
    close_s: float = 0.0  # the last writes and the fsyncs, after the last chunk was handed over

    def save(self, path: str) -> None:
        text = json.dumps(asdict(self))
        for_path(path).put_atomic(
            path, text.encode("utf-8"), tmp=f"{path}.tmp{os.getpid()}", sync=False, sync_dir=False
        )

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> WriterStats:
        """The fields this version knows: a bench JSON of an older run also holds the read thread's
        timings of the O_DIRECT reader, since removed."""
        known = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in d.items() if k in known})

    @classmethod
    def load(cls, path: str) -> WriterStats:
        with open(path, encoding="utf-8") as f:
            return cls.from_dict(json.load(f))


def requested_path() -> str | None:
    """FILE of SLIMCKPT_MERGE_STATS=FILE, or None when not asked for."""
    return env_vars.path(STATS_ENV)
