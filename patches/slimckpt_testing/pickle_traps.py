"""Booby-trapped checkpoints for tests/engine/test_pickle_policy.py and slimckpt_testing/scenarios/pickle_trap.py: a pickle
entry whose `__reduce__` calls `os.system("touch MARKER")`, planted the way someone handing over a
checkpoint could: in a verl rank file (model, optim, extra_state), in the incremental tier's extra
state, in a non-tensor record of its .distcp files, or in its dcp/.metadata, the step's manifest
resealed over the changed files (its checksums then vouch for them, as a sender's would)."""

from __future__ import annotations

import io
import os
import pickle
from pathlib import Path

import torch

# lazy imports: DCP and slimckpt's manifest load in the traps that write them

TRAPPED_GLOBAL = "posix.system"  # how os.system pickles on Linux


class Trap:
    """Unpickling it creates `marker`."""

    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


def trap_torch_file(path: Path, marker: Path) -> None:
    """One more entry in the dict `path` holds (a rank file, optimizer or extra state), saved as torch does."""
    obj = torch.load(path, weights_only=False, map_location="cpu")
    obj["evil"] = Trap(str(marker))
    torch.save(obj, path)


def trap_metadata(role_dir: Path, marker: Path) -> None:
    """dcp/.metadata with one more attribute holding the trap."""
    meta = role_dir / "dcp" / ".metadata"
    with open(meta, "rb") as f:
        metadata = pickle.load(f)
    metadata.planner_data = {"evil": Trap(str(marker))}
    with open(meta, "wb") as f:
        pickle.dump(metadata, f)
    reseal(role_dir)


def trap_bytes_record(role_dir: Path, marker: Path) -> str:
    """One non-tensor record of the step (an optimizer param_groups value, as DCP saves Python
    values) pointed at a new record appended to its .distcp file; returns its key."""
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata

    meta = role_dir / "dcp" / ".metadata"
    with open(meta, "rb") as f:
        metadata = pickle.load(f)
    keys = sorted(
        k
        for k, m in metadata.state_dict_metadata.items()
        if isinstance(m, BytesStorageMetadata) and k.startswith("optim.")
    )
    assert keys, "the step holds no non-tensor optimizer record"
    key = keys[0]
    index = next(i for i in metadata.storage_data if i.fqn == key)
    info = metadata.storage_data[index]
    buf = io.BytesIO()
    torch.save(Trap(str(marker)), buf)
    path = role_dir / "dcp" / info.relative_path
    offset = path.stat().st_size
    with open(path, "ab") as f:
        f.write(buf.getvalue())
    info.offset, info.length = offset, len(buf.getvalue())
    with open(meta, "wb") as f:
        pickle.dump(metadata, f)
    reseal(role_dir)
    return key


def trap_extra(role_dir: Path, marker: Path, rank: int = 0) -> None:
    """The incremental tier's extra state of `rank`, trapped and resealed."""
    path = next(role_dir.glob(f"slimckpt_extra_world_size_*_rank_{rank}.pt"))
    trap_torch_file(path, marker)
    reseal(role_dir)


def reseal(role_dir: Path) -> None:
    """The manifest rewritten over the files as they are now (sizes and checksums)."""
    from slimckpt.engine.resume_records import write_manifest
    from slimckpt.layout.resume_manifest import describe_files, read_manifest

    m = read_manifest(str(role_dir))
    m.files = describe_files(str(role_dir), [e.path for e in m.files])
    write_manifest(str(role_dir), m)
