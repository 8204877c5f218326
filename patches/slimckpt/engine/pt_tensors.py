"""Torch tensors made from `pt_index`'s byte offsets: the torch side of the one `.pt` reader.

`load` reads a `.pt` file as `torch.load(map_location="cpu")` would, through the same zip reader
and the same `RestrictedUnpickler` subclass as the torch-free index (`pt_index.RecordUnpickler`),
but with pickle_policy's allowed globals resolved to torch's (and numpy's) own objects: DTensors,
device meshes, placements, an lr scheduler's state, RNG states; FSDP1's ShardedTensor as a
stand-in of its metadata and local shards (`ShardedTensorState`: no process group needed). Only the
storages are ours: each one is a view of the file at the offset the index found, over one
memory map per file (`access`):

- `COPY` (what `torch.load(mmap=True)` does: MAP_PRIVATE): pages stay file-backed page cache, never
  anonymous memory, until someone writes to them (nobody does): verl's rank files, whose bytes the
  merge's bounded-RSS figures leave in the page cache;
- `READ`: a read-only map (DCP's `.distcp` files: a stray write faults instead of copying);
- `None`: the storages are read into memory (small files: extra state, DCP's byte records).
"""

from __future__ import annotations

import io
import mmap
import os
import warnings
from typing import Any

import torch

from slimckpt.engine import pt_index
from slimckpt.engine.pickle_policy import RestrictedUnpickler

COPY, READ = mmap.ACCESS_COPY, mmap.ACCESS_READ
_REBUILD_TENSOR = {("torch._utils", "_rebuild_tensor_v2"), ("torch._utils", "_rebuild_tensor_v3")}
_CPU = torch.device("cpu")


def mapping(path: str, access: int = COPY) -> mmap.mmap | None:
    """One memory map of the whole file (None for an empty file: it holds no bytes to map)."""
    with open(path, "rb") as f:
        if os.fstat(f.fileno()).st_size == 0:
            return None
        return mmap.mmap(f.fileno(), 0, access=access)


def _frombuffer(buffer, offset: int, nbytes: int) -> torch.Tensor:
    if nbytes == 0 or buffer is None:
        return torch.empty(0, dtype=torch.uint8)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "not writable" (READ): the merge never writes a source
        return torch.frombuffer(buffer, dtype=torch.uint8, count=nbytes, offset=offset)


def _view(base: torch.Tensor, dtype: torch.dtype, shape, stride, storage_offset: int) -> torch.Tensor:
    """`base` (a storage's bytes) as a tensor of `dtype`; as_strided checks it stays inside them."""
    width = torch.empty((), dtype=dtype).element_size()
    typed = base[: base.numel() - base.numel() % width].view(dtype)
    return typed.as_strided(tuple(shape), tuple(stride), storage_offset)


def tensor_at(
    buffer, offset: int, dtype: torch.dtype, shape: tuple[int, ...], stride: tuple[int, ...] | None = None
) -> torch.Tensor:
    """A tensor viewing the bytes of `buffer` (a `mapping`) from `offset`, contiguous (`stride`: as
    pickled, which may differ from torch's on dims of size 1); its start need not be aligned to the
    dtype's width (x86 and arm64 load unaligned data)."""
    width = torch.empty((), dtype=dtype).element_size()
    contiguous, step = [], 1
    for s in reversed(shape):
        contiguous.append(step)
        step *= max(s, 1)
    nbytes = width * (0 if 0 in shape else step)
    return _view(_frombuffer(buffer, offset, nbytes), dtype, shape, stride or tuple(reversed(contiguous)), 0)


def torch_dtype(record_dtype) -> torch.dtype:
    """The torch dtype of a pt_index dtype record (`torch.float32` for "float32")."""
    dtype = getattr(torch, record_dtype.name, None)
    if not isinstance(dtype, torch.dtype):
        raise pt_index.NotATorchFile(f"dtype {record_dtype.name}")
    return dtype


def record_tensor(buffer, record: pt_index.TensorRecord) -> torch.Tensor:
    """The torch tensor of a pt_index tensor record, viewing `buffer` (the `mapping` of its file)."""
    st = record.storage
    return _view(
        _frombuffer(buffer, st.data_offset, st.nbytes),
        torch_dtype(record.dtype),
        record.shape,
        record.stride,
        record.storage_offset,
    )


class ShardedTensorState(torch.Tensor):
    """Stand-in for FSDP1's ShardedTensor while unpickling: keeps its state, needs no process group
    (the real class demands a live one of the saving rank)."""

    def __setstate__(self, state):  # (local_shards, metadata, pg_state, sharding_spec, init_rrefs)
        self._slim_local_shards = state[0]
        self._slim_metadata = state[1]

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        raise TypeError("a ShardedTensor read by slimckpt is metadata only; use its local shards")


def sharded_tensor_metadata(value: Any) -> Any | None:
    """The metadata of an FSDP1 ShardedTensor as `load` reads it; None for any other value."""
    return value._slim_metadata if isinstance(value, ShardedTensorState) else None


class TorchUnpickler(pt_index.RecordUnpickler):
    """pt_index's unpickler with torch's own objects: tensors are views of `buffer` (a `mapping` of
    the file; None: each storage read into memory), FSDP1's ShardedTensor is `ShardedTensorState`,
    every other allowed global is the real one."""

    def __init__(self, file, path: str, records: pt_index.ZipRecords, buffer=None) -> None:
        super().__init__(file, path, records)
        self.buffer = buffer
        self._bases: dict[str, torch.Tensor] = {}  # storage key -> its bytes (views share them, as torch's do)

    def resolve(self, module: str, name: str):
        if (module, name) in _REBUILD_TENSOR:
            return self._rebuild_v2 if name.endswith("v2") else self._rebuild_v3
        if module == "torch" and name in pt_index.STORAGE_TYPES:
            return pt_index.STORAGE_TYPES[name]  # only ever named in a persistent id: the index's record
        if name.split(".")[0] == "ShardedTensor" and module.startswith("torch.distributed._shard.sharded_tensor"):
            real = RestrictedUnpickler.resolve(self, module, "ShardedTensor")
            # its pickle also names nested classes through the type (ShardedTensor.ProcessGroupState)
            ShardedTensorState.ProcessGroupState = real.ProcessGroupState
            return ShardedTensorState if name == "ShardedTensor" else RestrictedUnpickler.resolve(self, module, name)
        real = RestrictedUnpickler.resolve(self, module, name)
        if (module, name) == ("torch._utils", "_rebuild_wrapper_subclass"):
            # torch.load(map_location="cpu") puts a tensor subclass (DTensor) on the CPU too
            return lambda cls, dtype, size, stride, offset, layout, _device, grad: real(
                cls, dtype, size, stride, offset, layout, _CPU, grad
            )
        return real

    def _storage(self, st: pt_index.StorageRecord) -> torch.Tensor:
        base = self._bases.get(st.key)
        if base is None:
            if self.buffer is not None or st.nbytes == 0:
                base = _frombuffer(self.buffer, st.data_offset, st.nbytes)
            else:
                base = torch.frombuffer(bytearray(self.records.read_at(st.data_offset, st.nbytes)), dtype=torch.uint8)
            self._bases[st.key] = base
        return base

    def _tensor(self, storage, storage_offset, size, stride, dtype: torch.dtype, requires_grad, metadata):
        if not isinstance(storage, pt_index.StorageRecord):
            raise pt_index.NotATorchFile("a tensor without a storage")
        if metadata:
            raise pt_index.NotATorchFile("a tensor with metadata torch.save writes only for tensor subclasses")
        t = _view(self._storage(storage), dtype, size, stride, storage_offset)
        if requires_grad:
            t.requires_grad_(True)
        return t

    def _rebuild_v2(self, storage, storage_offset, size, stride, requires_grad, backward_hooks, metadata=None):
        if not isinstance(storage, pt_index.StorageRecord) or storage.dtype is None:
            raise pt_index.NotATorchFile("a typed storage")
        return self._tensor(storage, storage_offset, size, stride, torch_dtype(storage.dtype), requires_grad, metadata)

    def _rebuild_v3(self, storage, storage_offset, size, stride, requires_grad, backward_hooks, dtype, metadata=None):
        if not isinstance(dtype, torch.dtype):
            raise pt_index.NotATorchFile("a tensor's dtype")
        return self._tensor(storage, storage_offset, size, stride, dtype, requires_grad, metadata)


def load(path: str, access: int | None = COPY) -> Any:
    """The object a `.pt` file holds, as `torch.load(path, map_location="cpu", mmap=access is not None)`
    gives it, unpickled with pickle_policy's globals only (PickleRefused for any other); raises
    pt_index.NotATorchFile (or OSError) for a file torch.save did not write as it does."""
    buffer = mapping(path, access) if access is not None else None
    return pt_index.PtFile(path, TorchUnpickler, buffer=buffer).state


def load_bytes(data: bytes, path: str) -> Any:
    """`load` of a torch.save zip held in memory (a DCP byte record), naming `path` in refusals."""
    reader = pt_index.ZipRecords(io.BytesIO(data))
    unpickler = TorchUnpickler(io.BytesIO(reader.pickle()), path, reader, buffer=None)
    return unpickler.load()
