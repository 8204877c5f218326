"""Extra state of a rank (lr scheduler + RNG), as verl's extra_state: one file per saved rank.

On a load at another world size, rank r < saved world resumes saved rank r's RNG exactly; a rank
the saved run did not have gets a stream derived from saved rank r % saved_world's (rng_reshard).
"""

from __future__ import annotations

import os

import torch

from slimckpt.engine.safe_load import load_torch_file
from slimckpt.log import get_logger
from slimckpt.save import rng_reshard
from slimckpt.save.target import SaveTarget
from slimckpt.storage import for_path

log = get_logger("slimckpt.resume")

EXTRA_PREFIX = "slimckpt_extra_"
EXTRA_NAME = EXTRA_PREFIX + "world_size_{world}_rank_{rank}.pt"


def extra_path(local_path: str, world: int, rank: int) -> str:
    return os.path.join(local_path, EXTRA_NAME.format(world=world, rank=rank))


def save_extra(target: SaveTarget, local_path: str) -> str:
    """lr scheduler + RNG of this rank, as verl's extra_state (fsynced, renamed into place)."""
    path = extra_path(local_path, target.world_size, target.rank)
    state = {
        "lr_scheduler": target.lr_scheduler.state_dict() if target.lr_scheduler is not None else None,
        "rng": target.get_rng_state(),
    }
    with for_path(path).open_atomic(path, tmp=path + ".tmp", sync_dir=False) as f:
        torch.save(state, f)
    return path


def load_extra(target: SaveTarget, local_path: str, saved_world: int) -> None:
    """lr scheduler and RNG. The scheduler is the same on every rank. Rank r < saved_world resumes
    saved rank r's RNG exactly; a rank the saved run did not have gets a stream derived from
    saved rank r % saved_world's (rng_reshard), since a copy would repeat that rank's draws. On
    fewer ranks, the streams of the saved ranks beyond the new world size are not resumed."""
    source = target.rank % saved_world
    extra = load_torch_file(extra_path(local_path, saved_world, source))
    rng = extra.get("rng")
    if rng is not None:
        if target.rank >= saved_world:
            rng = rng_reshard.derive_rng_state(rng, target.rank)
        if target.load_rng_state is not None:
            target.load_rng_state(rng)
        message = rng_reshard.reshard_message(saved_world, target.world_size)
        if message and target.rank == 0:
            log.info("%s", message)
    if extra.get("lr_scheduler") is not None and target.lr_scheduler is not None:
        target.lr_scheduler.load_state_dict(extra["lr_scheduler"])


__all__ = ["EXTRA_NAME", "EXTRA_PREFIX", "extra_path", "load_extra", "save_extra"]
