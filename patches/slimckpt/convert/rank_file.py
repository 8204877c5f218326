"""One of verl's rank files (`torch.save` of a state dict of DTensors) written tensor by tensor.

verl's own save pickles a dict whose tensors are all in memory. Here the dict is first built of
fake tensors (no storage) and saved with torch's `skip_data`, which lays out every storage at its
final size and offset without writing its bytes; the file is then mapped shared (`torch.load`,
mmap, MAP_SHARED) and each tensor's bytes are copied in from the memory-mapped source, one
tensor at a time. Neither side's bytes pass through anonymous memory: both are page cache, and
the file is fsynced before the step is committed. The result loads with plain `torch.load`
exactly as verl's own file does (same structure, DTensors on the same mesh).
"""

from __future__ import annotations

import mmap
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from ..read.sources import SourceTensor


@dataclass(frozen=True)
class Slot:
    """Where one tensor of the file gets its bytes: `rows` [start, stop) of `source` (None: all of it)."""

    source: SourceTensor | torch.Tensor
    rows: tuple[int, int] | None


class Skeleton:
    """Builds the state dict to save: fake tensors, each with its Slot, found again by path after the load."""

    def __init__(self, mesh) -> None:
        from torch._subclasses.fake_tensor import FakeTensorMode

        self.mesh = mesh
        self.mode = FakeTensorMode()
        self.slots: dict[tuple, Slot] = {}

    def _fake(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        with self.mode:
            return torch.empty(shape, dtype=dtype)

    def sharded(self, path: tuple, source: SourceTensor, rows: tuple[int, int]):
        """A DTensor of `source`'s global shape, Shard(0) on the mesh, holding `rows` locally."""
        from torch.distributed.tensor import DTensor, Shard

        shape = tuple(source.shape)
        local = self._fake((rows[1] - rows[0], *shape[1:]), source.dtype)
        stride = tuple(int(s) for s in torch.empty(shape, device="meta").stride())
        self.slots[path] = Slot(source, rows)
        return DTensor.from_local(local, self.mesh, [Shard(0)], run_check=False, shape=torch.Size(shape),
                                  stride=stride)

    def plain(self, path: tuple, source: SourceTensor | torch.Tensor):
        """A plain tensor: the whole of `source` (a buffer, or an optimizer step count)."""
        shape = tuple(source.shape)
        self.slots[path] = Slot(source, None)
        return self._fake(shape, source.dtype)


def _at(obj: Any, path: tuple) -> Any:
    for key in path:
        obj = obj[key]
    return obj


def copy_rows(dest: torch.Tensor, source: SourceTensor | torch.Tensor, rows: tuple[int, int] | None) -> None:
    """dest := rows [start, stop) of source, read piece by piece from the source's shards."""
    if isinstance(source, torch.Tensor):
        dest.copy_(source)
        return
    if rows is None or source.shard_dim is None:
        whole = source.pieces[0]
        dest.copy_(whole if rows is None or whole.dim() == 0 else whole[rows[0]:rows[1]])
        return
    start, stop = rows
    offset = 0
    for piece in source.pieces:
        n = piece.shape[0]
        a, b = max(start, offset), min(stop, offset + n)
        if a < b:
            dest[a - start:b - start].copy_(piece[a - offset:b - offset])
        offset += n


def write(path: str, obj: Any, skeleton: Skeleton, on_bytes: Callable[[int], object] | None = None) -> None:
    """Save `obj` (built with `skeleton`) to `path`, then fill and fsync it."""
    from torch.distributed.tensor import DTensor

    with torch.serialization.skip_data(materialize_fake_tensors=True):
        torch.save(obj, path)
    # our own file, just written: torch's loader rebuilds its DTensors and meshes
    with torch.serialization.set_default_mmap_options(mmap.MAP_SHARED):
        mapped = torch.load(path, mmap=True, weights_only=False, map_location="cpu")
    try:
        with torch.no_grad():
            for where, slot in skeleton.slots.items():
                dest = _at(mapped, where)
                if isinstance(dest, DTensor):
                    dest = dest._local_tensor
                copy_rows(dest, slot.source, slot.rows)
                if on_bytes is not None:
                    on_bytes(dest.numel() * dest.element_size())
    finally:
        del mapped
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
