"""Whether a committed step is intact, agreed by every rank before a load reads any of it.

resume_manifest.role_damage is the one definition of intact (`slimckpt verify`'s too); the ranks
share the work: each checks size and checksum of its share of the listed files (about equal
bytes), rank 0 also looks for unlisted files and failure markers. Every rank raises the same
first message, the line `slimckpt verify` prints for that file.
"""

from __future__ import annotations

from typing import Any

import torch.distributed as dist

from slimckpt.dist import outcome
from slimckpt.layout.resume_manifest import MANIFEST_NAME, Manifest, UncommittedCheckpoint, role_damage


def check_committed(local_path: str, group: Any, checksums: bool = True) -> Manifest:
    """The step's manifest, or UncommittedCheckpoint on every rank (collective over `group`);
    `checksums` False checks sizes only (checkpoint.verify: false)."""
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    manifest, damage = role_damage(local_path, checksums=checksums, share=(rank, world), extras=rank == 0)
    # the first damaged file in the manifest's order, whichever rank checked it
    mine = outcome.Failure(rank, damage[0].message, order=damage[0].index) if damage else None
    outcome.agree(group, mine, lambda failure: UncommittedCheckpoint(failure.line))
    if manifest is None:
        raise UncommittedCheckpoint(
            f"slimckpt: {local_path}/{MANIFEST_NAME} is unreadable on rank {rank}; "
            f"make the checkpoint dir readable from every node (one shared filesystem)"
        )
    return manifest


__all__ = ["check_committed"]
