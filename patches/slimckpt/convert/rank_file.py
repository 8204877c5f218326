"""One of verl's rank files (`torch.save` of a state dict of DTensors) written tensor by tensor.

verl's own save pickles a dict whose tensors are all in memory. Here the dict is first built of
fake tensors (no storage) and saved with torch's `skip_data`, which lays out every storage at its
final size and offset without writing its bytes; the one `.pt` reader (`read.pt_index`) then finds
each tensor's bytes in the file, which is mapped shared (MAP_SHARED), and each tensor's bytes are
copied in from the memory-mapped source, one tensor at a time. Neither side's bytes pass through anonymous memory: both are page cache, and
the file is fsynced before the step is committed. The result loads with plain `torch.load`
exactly as verl's own file does (same structure, DTensors on the same mesh).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch.distributed.tensor import DTensor, Shard

from slimckpt import internals
from slimckpt.engine import pt_index, pt_tensors
from slimckpt.engine.verl_sources import SourceTensor
from slimckpt.storage import for_path


class FlatSource:
    """A tensor of the step as runs of its row-major elements: its pieces (contiguous, memory-mapped)
    flattened and read one after another give the whole tensor."""

    def __init__(self, shape: tuple[int, ...], dtype: torch.dtype, pieces: list[torch.Tensor], where: str) -> None:
        self.shape, self.dtype, self.where = tuple(shape), dtype, where
        self.pieces = [p.reshape(-1) for p in pieces]
        total = sum(p.numel() for p in self.pieces)
        expect = 1
        for d in self.shape:
            expect *= d
        if total != expect:
            raise ValueError(f"{where}: its pieces hold {total} elements, its shape {list(self.shape)} {expect}")

    @classmethod
    def of(cls, source: SourceTensor | torch.Tensor, where: str = "") -> FlatSource:
        if isinstance(source, torch.Tensor):
            return cls(tuple(source.shape), source.dtype, [source.reshape(-1)], where)
        pieces = source.pieces if source.shard_dim is not None else source.pieces[:1]
        if source.shard_dim not in (None, 0):
            raise ValueError(f"{where}: sharded along dim {source.shard_dim}, not 0")
        return cls(source.shape, source.dtype, pieces, where or source.file_of(0))

    @property
    def row_numel(self) -> int:
        n = 1
        for d in self.shape[1:]:
            n *= d
        return n

    def copy_into(self, dest: torch.Tensor, start: int, stop: int) -> None:
        """dest (1-D) := elements [start, stop) of the flattened tensor."""
        offset = 0
        for piece in self.pieces:
            n = piece.numel()
            a, b = max(start, offset), min(stop, offset + n)
            if a < b:
                dest[a - start : b - start].copy_(piece[a - offset : b - offset])
            offset += n


@dataclass(frozen=True)
class Run:
    """Elements [start, stop) of `source` go to element `at` of the file's tensor."""

    at: int
    source: FlatSource
    start: int
    stop: int


@dataclass(frozen=True)
class Slot:
    runs: tuple[Run, ...]
    zero: bool  # elements no run covers are padding: written as zeros


class Skeleton:
    """Builds the state dict to save: fake tensors, each with its Slot, found again by path after the load."""

    def __init__(self, mesh) -> None:
        fake_mode = internals.lookup("torch._subclasses.fake_tensor:FakeTensorMode")
        if fake_mode is None:  # no public way to lay out a tensor without its storage
            raise RuntimeError(
                f"slimckpt convert: torch {internals.release('torch')}'s FakeTensorMode is not one "
                f"slimckpt was checked on; {internals.TRUST_ENV}=1 tries it anyway"
            )
        self.mesh = mesh
        self.mode = fake_mode()
        self.slots: dict[tuple, Slot] = {}

    def _fake(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        with self.mode:
            return torch.empty(shape, dtype=dtype)

    def sharded(self, path: tuple, source: FlatSource, rows: tuple[int, int]):
        """A DTensor of `source`'s global shape, Shard(0) on the mesh, holding `rows` locally."""
        shape = source.shape
        local = self._fake((rows[1] - rows[0], *shape[1:]), source.dtype)
        stride = tuple(int(s) for s in torch.empty(shape, device="meta").stride())
        k = source.row_numel
        self.slots[path] = Slot((Run(0, source, rows[0] * k, rows[1] * k),), False)
        return DTensor.from_local(local, self.mesh, [Shard(0)], run_check=False, shape=torch.Size(shape), stride=stride)

    def plain(self, path: tuple, source: FlatSource):
        """A plain tensor: the whole of `source` (a buffer, or an optimizer step count)."""
        n = 1
        for d in source.shape:
            n *= d
        self.slots[path] = Slot((Run(0, source, 0, n),), False)
        return self._fake(source.shape, source.dtype)

    def flat(self, path: tuple, numel: int, dtype: torch.dtype, runs: list[Run]):
        """A 1-D plain tensor assembled from runs of several sources (an FSDP1 flat shard), zeros elsewhere."""
        self.slots[path] = Slot(tuple(runs), True)
        return self._fake((numel,), dtype)


def _at(obj: Any, path: tuple) -> Any:
    for key in path:
        obj = obj[key]
    return obj


def write(path: str, obj: Any, skeleton: Skeleton, on_bytes: Callable[[int], object] | None = None) -> None:
    """Save `obj` (built with `skeleton`) to `path`, then fill and fsync it."""
    with torch.serialization.skip_data(materialize_fake_tensors=True):
        torch.save(obj, path)
    laid_out = pt_index.PtFile(path).state  # our own file, just written: where each tensor's bytes go
    buffer = pt_tensors.mapping(path, pt_tensors.WRITE)
    try:
        with torch.no_grad():
            for where, slot in skeleton.slots.items():
                record = _at(laid_out, where)
                if isinstance(record, pt_index.DTensorStub):
                    record = record.state["_local_tensor"]
                dest = pt_tensors.record_tensor(buffer, record)
                flat = dest.view(-1)
                if slot.zero:
                    flat.zero_()
                for run in slot.runs:
                    run.source.copy_into(flat[run.at : run.at + run.stop - run.start], run.start, run.stop)
                if on_bytes is not None:
                    on_bytes(dest.numel() * dest.element_size())
                del dest, flat  # the map is closed below: no view of it may outlive the loop
    finally:
        if buffer is not None:
            try:
                buffer.close()
            except BufferError:  # a view still held (an error mid-copy): the map closes when it goes
                pass
    for_path(path).sync(path)
