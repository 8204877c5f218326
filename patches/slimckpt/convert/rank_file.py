"""One of verl's rank files (`torch.save` of a state dict of DTensors) written tensor by tensor.

verl's own save pickles a dict whose tensors are all in memory. Here the dict is first built of
fake tensors (no storage) and saved with torch's `skip_data`, which lays out every storage at its
final size and offset without writing its bytes; the one `.pt` reader (`read.pt_index`) then finds
each tensor's bytes in the file, and the range writer (`engine.out_files`, the merge's) writes them
there from the memory-mapped source, one tensor at a time, in chunks: straight from the source's
pages when the dtype is the same (a convert does not cast), through a staging buffer otherwise, and
fsyncs the file before the step is committed. The result loads with plain `torch.load` exactly as
verl's own file does (same structure, DTensors on the same mesh).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch.distributed.tensor import DTensor, Shard

from slimckpt import internals
from slimckpt.engine import pt_index, pt_tensors
from slimckpt.engine.out_files import OutputFiles
from slimckpt.engine.share_writer import as_bytes, byte_buffer, staged
from slimckpt.engine.verl_sources import SourceTensor
from slimckpt.layout.names import DEFAULT_CHUNK_BYTES
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

    def spans(self, start: int, stop: int) -> Iterator[tuple[torch.Tensor, int, int]]:
        """(piece, a, b): elements [a, b) of each piece that together are elements [start, stop) of
        the flattened tensor, in order."""
        offset = 0
        for piece in self.pieces:
            n = piece.numel()
            a, b = max(start, offset), min(stop, offset + n)
            if a < b:
                yield piece, a - offset, b - offset
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


def _gaps(covered: list[tuple[int, int]], numel: int) -> list[tuple[int, int]]:
    """The element ranges of [0, numel) no (start, stop) of `covered` holds."""
    gaps, at = [], 0
    for a, b in sorted(covered):
        if a > at:
            gaps.append((at, a))
        at = max(at, b)
    if at < numel:
        gaps.append((at, numel))
    return gaps


def _fill(out: OutputFiles, name: str, record: pt_index.TensorRecord, slot: Slot, chunk_bytes: int) -> None:
    """The bytes of one laid-out tensor of file `name`: each run of its sources at its offset, zeros
    in what no run covers (an FSDP1 flat shard's padding)."""
    dtype = pt_tensors.torch_dtype(record.dtype)
    width = dtype.itemsize
    for run in slot.runs:
        at = record.offset + run.at * width
        for piece, a, b in run.source.spans(run.start, run.stop):
            step = max(1, chunk_bytes // max(width, piece.element_size()))
            for s in range(a, b, step):
                data = as_bytes(staged(out, piece[s : min(b, s + step)], dtype))
                out.submit(name, data, at)
                at += len(data)
    if slot.zero:
        step = max(1, chunk_bytes // width)
        for a, b in _gaps([(r.at, r.at + r.stop - r.start) for r in slot.runs], record.numel):
            for s in range(a, b, step):
                nbytes = (min(b, s + step) - s) * width
                zeros = out.stage(nbytes)[:nbytes]
                zeros.zero_()
                out.submit(name, as_bytes(zeros), record.offset + s * width)


def write(
    path: str,
    obj: Any,
    skeleton: Skeleton,
    on_bytes: Callable[[int], object] | None = None,
    chunk_bytes: int = DEFAULT_CHUNK_BYTES,
) -> None:
    """Save `obj` (built with `skeleton`) to `path`, then fill and fsync it."""
    with torch.serialization.skip_data(materialize_fake_tensors=True):
        torch.save(obj, path)
    laid_out = pt_index.PtFile(path).state  # our own file, just written: where each tensor's bytes go
    name = os.path.basename(path)
    out = OutputFiles(os.path.dirname(path), None, byte_buffer, chunk_bytes)
    try:
        with torch.no_grad():
            for where, slot in skeleton.slots.items():
                record = _at(laid_out, where)
                if isinstance(record, pt_index.DTensorStub):
                    record = record.state["_local_tensor"]
                _fill(out, name, record, slot, chunk_bytes)
                if on_bytes is not None:
                    on_bytes(record.numel * record.dtype.itemsize)
    except BaseException:
        out.abort()
        raise
    out.close()  # fsyncs the file, if a tensor was written to it
    if not skeleton.slots:
        for_path(path).sync(path)
