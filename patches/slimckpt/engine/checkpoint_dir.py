"""A verl FSDP checkpoint dir as files, without torch: which rank files it must hold and what
`fsdp_config.json` says. The merge checks these before its imports (seconds), so a wrong
`--local_dir` fails at once; `sources.py` reads the files themselves.
"""

from __future__ import annotations

import json
import os
import re

from slimckpt import SlimckptError
from slimckpt.layout.names import DCP_DIR, FSDP_CONFIG, HF_SUBDIR  # noqa: F401 - the readers take them from here
from slimckpt.storage import for_path

MODEL_FILE_RE = re.compile(r"^model_world_size_(\d+)_rank_(\d+)\.pt$")


class CheckpointError(SlimckptError, RuntimeError):
    """A problem with the input checkpoint; the message names the file and the fix, on one line."""


def model_file(local_dir: str, world_size: int, rank: int) -> str:
    return os.path.join(local_dir, f"model_world_size_{world_size}_rank_{rank}.pt")


def rank_files(local_path: str, rank: int) -> list[str]:
    """Every file rank `rank` wrote into a role dir, relative to it, sorted: verl's per-rank files
    (`*_rank_{r}.*`: model, optim, extra state, slimckpt's extra state) and the incremental tier's
    `dcp/__{r}_*.distcp`. The one listing of a rank's files (save metrics, a failed save's cleanup,
    the incremental tier's manifest)."""
    store = for_path(local_path)
    if not store.is_dir(local_path):
        return []
    marker = f"_rank_{rank}."
    names = store.list_dir(local_path)
    files = [n for n in names if marker in n and not store.is_dir(os.path.join(local_path, n))]
    if DCP_DIR in names:
        dcp_dir = os.path.join(local_path, DCP_DIR)
        files += [
            f"{DCP_DIR}/{n}" for n in store.list_dir(dcp_dir) if n.startswith(f"__{rank}_") and n.endswith(".distcp")
        ]
    return sorted(files)


def read_fsdp_config(local_dir: str) -> tuple[int, int | None]:
    path = os.path.join(local_dir, FSDP_CONFIG)
    if not os.path.isdir(local_dir):
        raise CheckpointError(
            f"{local_dir}: no such checkpoint directory; pass --local_dir <default_local_dir>/global_step_N/actor"
        )
    if not os.path.isfile(path):
        raise CheckpointError(
            f"{path} is missing: not a verl FSDP checkpoint dir, or the save was "
            f"interrupted; point --local_dir at a complete global_step_N/actor dir"
        )
    try:
        with open(path) as f:
            cfg = json.load(f)
        world = int(cfg["world_size"])
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise CheckpointError(
            f'{path}: unreadable ({exc}); it should hold {{"FSDP_version": 2, "world_size": W}} as verl writes it'
        ) from None
    version = cfg.get("FSDP_version")
    return world, int(version) if version is not None else None


def check_rank_files(local_dir: str, world_size: int) -> list[str]:
    """The W model files, checked: none missing, none of another world size."""
    others: dict[int, list[str]] = {}
    for name in os.listdir(local_dir):
        m = MODEL_FILE_RE.match(name)
        if m and int(m.group(1)) != world_size:
            others.setdefault(int(m.group(1)), []).append(name)
    if others:
        sizes = ", ".join(f"world size {w} ({len(v)} files, e.g. {sorted(v)[0]})" for w, v in sorted(others.items()))
        raise CheckpointError(
            f"{local_dir}: holds model files of two world sizes: {world_size} "
            f"(from {FSDP_CONFIG}) and {sizes}; remove the stale files or merge "
            f"from a clean checkpoint dir"
        )
    paths = [model_file(local_dir, world_size, r) for r in range(world_size)]
    for path in paths:
        if not os.path.isfile(path):
            raise CheckpointError(
                f"{path} is missing ({FSDP_CONFIG} says world size {world_size}); "
                f"copy every rank's model file into {local_dir}"
            )
    return paths
