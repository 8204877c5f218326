"""The checkpoint group of a save target: a gloo group of its ranks for DCP's coordination and the commit.

Object collectives stay off the accelerator, and a background write never shares a group (and so a
collective order) with training. One per target, so actor and critic never interleave.
"""

from __future__ import annotations

import torch.distributed as dist

import slimckpt.dist.heartbeat as peers
from slimckpt.save.target import TargetState


def checkpoint_group(state: TargetState) -> dist.ProcessGroup:
    """The target's group, made (collectively, on every rank) by its first save or load."""
    if state.group is None:
        # the job's own timeout (torch would give a gloo group 30 minutes), and a heartbeat so that a
        # collective that loses a rank can name it
        state.group = dist.new_group(backend="gloo", timeout=peers.default_group_timeout())
        peers.process_heartbeat()
    return state.group


def made_group(state: TargetState) -> dist.ProcessGroup | None:
    """The target's group if a save or load made it (on every rank), else None."""
    return state.group


__all__ = ["checkpoint_group", "made_group"]
