"""What `slimckpt convert` writes, decided before any tensor is read. Pure: no torch.

FSDP2 (and FSDP1 with a device mesh, what verl builds) shard every parameter along dim 0 the way
torch.chunk does: ceil(rows / M) rows per rank, the last ranks short or empty. verl's rank files
hold, per rank, that run of rows of each parameter (model) and of each optimizer state tensor.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass

from slimckpt import SlimckptError
from slimckpt.layout.resume_manifest import TRACKER_NAME
from slimckpt.storage import absolute, for_path

STEP_RE = re.compile(r"^global_step_(\d+)$")
ROLES = ("actor", "critic")
PARTIAL = ".partial"


class ConvertError(SlimckptError, RuntimeError):
    """Bad input to `slimckpt convert`; the message is one line naming the file and the fix."""


def row_range(rows: int, world: int, rank: int) -> tuple[int, int]:
    """Rows [start, stop) of a tensor with `rows` rows that rank `rank` of `world` holds (torch.chunk)."""
    per = -(-rows // world) if rows else 0
    start = min(rows, per * rank)
    return start, min(rows, start + per)


@dataclass(frozen=True)
class Target:
    """Where a convert writes: `<root>/global_step_N` via `<root>/global_step_N.partial`."""

    root: str
    step: int

    @property
    def step_dir(self) -> str:
        return os.path.join(self.root, f"global_step_{self.step}")

    @property
    def partial_dir(self) -> str:
        return self.step_dir + PARTIAL

    @property
    def tracker(self) -> str:
        return os.path.join(self.root, TRACKER_NAME)


def parse_step_dir(path: str) -> tuple[str, int, list[str]]:
    """(checkpoint root, N, roles present) of `<root>/global_step_N`; a role dir is accepted too."""
    store = for_path(path)
    path = absolute(path).rstrip("/")  # a local path normalised, a URL as it is
    if os.path.basename(path) in ROLES and STEP_RE.match(os.path.basename(os.path.dirname(path))):
        path = os.path.dirname(path)
    m = STEP_RE.match(os.path.basename(path))
    if not m or not store.is_dir(path):
        raise ConvertError(f"{path}: not a step directory; pass <trainer.default_local_dir>/global_step_N")
    roles = [r for r in ROLES if store.is_dir(os.path.join(path, r))]
    if not roles:
        raise ConvertError(f"{path}: holds no actor/ or critic/ dir; pass a step that a save finished")
    return os.path.dirname(path), int(m.group(1)), roles


def default_target_root(source_root: str, world: int) -> str:
    return f"{os.path.normpath(source_root)}_verl_ws{world}"


def plan_target(source_root: str, step: int, world: int, target_dir: str | None, overwrite: bool) -> Target:
    if world < 1:
        raise ConvertError(f"--world-size {world}: a checkpoint needs at least one rank; pass 1 or more")
    root = os.path.abspath(target_dir) if target_dir else default_target_root(source_root, world)
    target = Target(root, step)
    if os.path.normpath(target.step_dir) == os.path.normpath(os.path.join(source_root, f"global_step_{step}")):
        raise ConvertError(f"{target.step_dir}: the target is the step being read; pass another --target_dir")
    if os.path.exists(target.step_dir) and not overwrite:
        raise ConvertError(f"{target.step_dir} exists; pass --overwrite to replace it, or another --target_dir")
    return target


def check_world_size(shapes: dict[str, tuple[int, ...]], world: int, fsdp: int, where: str) -> None:
    """Refuse a world size whose shards verl could not build. Dim-0 shards of any size are fine
    (FSDP pads short and empty ones); a 0-d parameter has no dim to shard (fully_shard refuses it)."""
    scalars = [name for name, shape in shapes.items() if len(shape) == 0]
    if scalars and fsdp == 2 and world > 1:
        raise ConvertError(
            f"{where}: parameter {scalars[0]!r} is 0-d, and FSDP2 cannot shard a 0-d parameter over "
            f"{world} ranks; convert with --world-size 1"
        )


def flat_offsets(numels: list[int]) -> list[int]:
    """Where each parameter starts in an FSDP1 flat parameter built with use_orig_params=False
    (verl's default): one after another, no alignment padding."""
    out, at = [], 0
    for n in numels:
        out.append(at)
        at += n
    return out


def flat_shard(total: int, world: int) -> int:
    """Elements of each rank's shard of a flat parameter of `total` elements: FSDP1 pads the flat
    parameter to a multiple of the world size and gives every rank the same run."""
    return -(-total // world)


def flat_runs(numels: list[int], world: int, rank: int) -> list[tuple[int, int, int, int]]:
    """(parameter index, first element of it, end, where in the rank's shard) for every parameter
    of a flat parameter that rank `rank` of `world` holds part of."""
    size = flat_shard(sum(numels), world)
    lo, hi = rank * size, (rank + 1) * size
    runs = []
    for i, (start, n) in enumerate(zip(flat_offsets(numels), numels)):
        a, b = max(lo, start), min(hi, start + n)
        if a < b:
            runs.append((i, a - start, b - start, a - lo))
    return runs
