"""Which reader a merge's `--local_dir` gets: verl's rank files (`sources`) or an incremental-tier
step's dcp/ (`dcp_source`, told apart by `dcp_step.is_dcp_role_dir`). The check runs before torch
is imported, so a wrong or damaged input fails before seconds of imports.
"""

from __future__ import annotations

# lazy imports: torch-free until a reader opens the input, so a wrong --local_dir fails before torch is imported
from slimckpt.engine import dcp_step
from slimckpt.engine.checkpoint_dir import check_rank_files, read_fsdp_config


def check_source(local_dir: str, checksums: bool = True) -> None:
    """Raise CheckpointError (one line) unless `local_dir` can be merged: verl's rank files all there;
    or an incremental-tier step committed and intact (every file's checksum: the one full read of it,
    unless `checksums` is False: checked where it was fetched from)."""
    world = read_fsdp_config(local_dir)[0]
    if dcp_step.is_dcp_role_dir(local_dir):
        dcp_step.check_step(local_dir, checksums=checksums)
    else:
        check_rank_files(local_dir, world)


def open_source(local_dir: str):
    """The opened input as `sources.VerlFsdpCheckpoint` (its tensors memory-mapped); raises CheckpointError."""
    if dcp_step.is_dcp_role_dir(local_dir):
        from slimckpt.engine.dcp_source import open_dcp

        return open_dcp(local_dir)
    from slimckpt.engine.verl_sources import open_checkpoint

    return open_checkpoint(local_dir)
