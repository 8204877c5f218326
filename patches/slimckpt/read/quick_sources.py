"""A fast, speculative reader of the common verl checkpoint: FSDP on a 1-D mesh (DTensors with one
Shard or Replicate placement) and plain tensors, for the merge's early writer only.

`sources.open_checkpoint` unpickles the rank files with torch's real DTensor and DeviceMesh classes,
which costs an import of `torch.distributed.tensor` (0.9 s here) before the first byte can be
written. Here every `torch.distributed` class in the pickle is replaced by a stand-in that only
keeps its state (the tensors themselves are torch's usual memory-mapped storages), and the few
facts a merge needs are read from that state. What comes out is a guess: the merge compares it
(`signature`) with what the real reader makes of the same files, and an early write from a
different reading is discarded and rewritten, as a wrongly guessed layout is. Anything this reader
does not recognise makes it return None (then the early writer uses the real reader), and so does
a global pickle_policy refuses (the real reader then refuses it, naming it).

No torch.distributed here, by design.
"""

from __future__ import annotations

import os

import torch

from . import sources
from .pickle_policy import RestrictedUnpickler, pickle_module
from .sources import SourceTensor, VerlFsdpCheckpoint


class _State:
    """Stand-in for any torch.distributed object: keeps constructor arguments and pickled state."""

    _slim_name = "?"

    def __init__(self, *args, **kwargs) -> None:
        self._slim_args = args
        self.__dict__.update(kwargs)

    def __setstate__(self, state) -> None:
        for part in state if isinstance(state, tuple) else (state,):
            if isinstance(part, dict):
                self.__dict__.update(part)


class _DTensorState(torch.Tensor):
    """Stand-in for DTensor: a wrapper tensor of the global shape holding the pickled state."""

    def __setstate__(self, state) -> None:
        for part in state if isinstance(state, tuple) else (state,):
            if isinstance(part, dict):
                self._slim_state = part

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        raise TypeError("a DTensor read by slimckpt.read.quick_sources is metadata only; use its local tensor")


class _Unpickler(RestrictedUnpickler):
    _made: dict[tuple[str, str], type] = {}

    def resolve(self, module: str, name: str):
        if module.startswith("torch.distributed"):
            if name == "DTensor":
                return _DTensorState
            key = (module, name)
            if key not in self._made:
                self._made[key] = type(name, (_State,), {"_slim_name": f"{module}.{name}"})
            return self._made[key]
        return super().resolve(module, name)


class _NotSimple(Exception):
    pass


def open_quick(local_dir: str) -> VerlFsdpCheckpoint | None:
    """The checkpoint as `sources.open_checkpoint` would read it, when it is the simple kind; else None."""
    local_dir = os.path.abspath(local_dir)
    try:
        world, version = sources.read_fsdp_config(local_dir)
        paths = sources.check_rank_files(local_dir, world)
        sds = [torch.load(p, mmap=True, weights_only=False, map_location="cpu",
                          pickle_module=pickle_module(_Unpickler, p)) for p in paths]
        if not all(isinstance(sd, dict) for sd in sds) or any(set(sd) != set(sds[0]) for sd in sds[1:]):
            return None
        tensors = {}
        for key, v0 in sds[0].items():
            if not isinstance(v0, torch.Tensor):
                return None  # the real reader logs what it skips
            st = _source(key, [sd[key] for sd in sds], world)
            st.local_dir, st.world_size = local_dir, world
            tensors[key] = st
    except Exception:  # noqa: BLE001 - not the simple kind, or damaged: the real reader decides and reports
        return None
    return VerlFsdpCheckpoint(local_dir=local_dir, world_size=world, fsdp_version=version, state_dicts=sds,
                              tensors=tensors, mesh=None)


def _placement(v: _DTensorState, rank: int) -> tuple[str, int | None]:
    spec = v._slim_state["_spec"]
    placements = tuple(spec.placements)
    coord = getattr(spec.mesh, "_coordinate_on_dim", (rank,))
    if len(placements) != 1 or tuple(coord or ()) != (rank,):
        raise _NotSimple  # 2-D meshes and remapped ranks: the real reader
    kind = type(placements[0]).__name__
    if kind == "Shard":
        return kind, int(placements[0].dim)
    if kind == "Replicate":
        return kind, None
    raise _NotSimple


def _source(key: str, values: list, world: int) -> SourceTensor:
    v0 = values[0]
    shape = tuple(v0.shape)
    if type(v0) is torch.Tensor:  # plain: every rank's copy, compared as verl does
        if any(type(v) is not torch.Tensor or tuple(v.shape) != shape for v in values):
            raise _NotSimple
        return SourceTensor(key, shape, v0.dtype, None, list(values), list(range(world)))
    if not isinstance(v0, _DTensorState):
        raise _NotSimple
    kinds = [_placement(v, r) for r, v in enumerate(values)]
    if len(set(kinds)) != 1 or any(tuple(v.shape) != shape for v in values):
        raise _NotSimple
    kind, dim = kinds[0]
    locals_ = [v._slim_state["_local_tensor"] for v in values]
    if kind == "Replicate":
        return SourceTensor(key, shape, locals_[0].dtype, None, locals_[:1], [0], replicated_dtensor=True)
    dim = dim + len(shape) if dim < 0 else dim
    if sum(t.shape[dim] for t in locals_) != shape[dim]:
        raise _NotSimple
    return SourceTensor(key, shape, locals_[0].dtype, dim, locals_, list(range(world)))


def signature(ckpt: VerlFsdpCheckpoint, name_map: dict[str, str]) -> list[tuple]:
    """What the merge's bytes depend on, per output tensor: source shape, dtype, sharding, ranks, and
    where each piece sits in which file. Equal signatures write equal bytes."""
    from .direct_read import MappedFiles

    paths = sorted({st.file_of(k) for st in ckpt.tensors.values() for k in range(len(st.pieces))})
    files = MappedFiles(paths)
    out = []
    for new, old in name_map.items():
        st = ckpt.tensors[old]
        pieces = []
        for p in st.pieces:
            where = files.locate(p)
            pieces.append((where, tuple(p.shape), tuple(p.stride()), str(p.dtype)))
        out.append((new, old, tuple(st.shape), str(st.dtype), st.shard_dim, tuple(st.ranks),
                    st.replicated_dtensor, tuple(pieces)))
    return out
