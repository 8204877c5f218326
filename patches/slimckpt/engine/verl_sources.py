"""Readers of verl FSDP checkpoint directories, memory-mapped.

A verl FSDP checkpoint dir (`<run>/global_step_N/actor`) holds, per rank r of W,
`model_world_size_{W}_rank_{r}.pt` (the rank's SHARDED_STATE_DICT, `torch.save`d), plus
`fsdp_config.json` ({"FSDP_version", "world_size"}) and `huggingface/` (config, tokenizer).

What the model files hold (checked on verl 0.9.1 / torch 2.13):
- FSDP2 (`fully_shard`): DTensors. 1-D mesh ("fsdp",): placements (Shard(0),); 2-D mesh
  ("ddp","fsdp") (hybrid sharding): (Replicate(), Shard(0)). Shards follow torch.chunk, so the
  last ones may be short or empty (world size 3).
- FSDP1 with a device mesh (what verl always builds): DTensors too, same placements.
- FSDP1 without a device mesh: ShardedTensors, whose unpickling normally demands a live process
  group of the saving rank; they are read here through a stand-in class (offsets included).
- Tensors FSDP does not shard (buffers, ignored params): plain tensors stored on every rank.

Every file is read by the one `.pt` reader (`pt_index`, its tensors made by `pt_tensors` from the
offsets it finds, over a private memory map as `torch.load(mmap=True)` makes): shard bytes stay
file-backed (page cache), never a whole rank file in anonymous memory. The result is one
`SourceTensor` per state-dict key, in the checkpoint's order, with lazy per-shard views.
"""

from __future__ import annotations

# lazy imports: torch.distributed.tensor only once a DTensor is looked at (0.9 s)
import os
from dataclasses import dataclass, field
from typing import Any

import torch

from slimckpt.engine import pt_tensors
from slimckpt.engine.checkpoint_dir import (
    FSDP_CONFIG,
    HF_SUBDIR,
    CheckpointError,
    check_rank_files,
    model_file,
    read_fsdp_config,
)
from slimckpt.engine.pickle_policy import PickleRefused
from slimckpt.engine.pt_tensors import ShardedTensorState, sharded_tensor_metadata  # noqa: F401 - verify's reader of them
from slimckpt.layout import names
from slimckpt.log import get_logger, quieted

log = get_logger("slimckpt.sources")


TORCH_TO_SAFETENSORS: dict[torch.dtype, str] = names.by_torch_dtype(torch)


@dataclass
class SourceTensor:
    """One state-dict entry of the checkpoint.

    Sharded (`shard_dim` set): `pieces[k]` is shard k along the FSDP mesh dim, in order; their
    lengths along `shard_dim` add up to `shape[shard_dim]`. Plain (`shard_dim` None): `pieces`
    are the per-rank copies verl compares (`pieces[0]` is the one written).
    """

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    shard_dim: int | None
    pieces: list[torch.Tensor]
    ranks: list[int]  # rank file each piece came from, for error messages
    replicated_dtensor: bool = False  # a DTensor with only Replicate placements: verl keeps rank 0's
    local_dir: str = ""
    world_size: int = 0
    files: list[str] = field(default_factory=list)  # the file of each piece, where not verl's rank files (dcp/)

    def file_of(self, k: int) -> str:
        """The rank file piece k came from (named in error messages)."""
        if self.files:
            return self.files[k]
        name = (
            f"model_world_size_{self.world_size}_rank_{self.ranks[k]}.pt"
            if self.world_size
            else f"model_world_size_*_rank_{self.ranks[k]}.pt"
        )
        return os.path.join(self.local_dir, name) if self.local_dir else name

    @property
    def sharded(self) -> bool:
        return self.shard_dim is not None

    @property
    def shard_sizes(self) -> list[int]:
        assert self.shard_dim is not None
        return [p.shape[self.shard_dim] for p in self.pieces]


@dataclass
class MeshInfo:
    dim_names: tuple[str, ...]
    mesh: list  # nested list of ranks


@dataclass
class VerlFsdpCheckpoint:
    """An opened, validated verl FSDP checkpoint dir. Use `open_checkpoint`."""

    local_dir: str
    world_size: int
    fsdp_version: int | None
    state_dicts: list[dict] = field(repr=False)  # per rank, memory-mapped
    tensors: dict[str, SourceTensor] = field(repr=False)
    mesh: MeshInfo | None
    skipped: list[str] = field(default_factory=list)  # non-tensor entries
    source_format: str = "verl_fsdp"  # or dcp_source.SOURCE_FORMAT: an incremental-tier step's dcp/

    @property
    def hf_dir(self) -> str:
        return os.path.join(self.local_dir, HF_SUBDIR)

    def model_file(self, rank: int) -> str:
        return model_file(self.local_dir, self.world_size, rank)

    def has_lora(self) -> bool:
        return any(names.is_lora_key(name) for name in self.tensors)

    def close(self) -> None:
        self.state_dicts.clear()
        self.tensors.clear()


def load_mmap(path: str) -> Any:
    """One of verl's rank files as torch.load(mmap=True) reads it, tensors left file-backed; verl's
    files hold DTensors, FSDP1's ShardedTensors (read as metadata: `sharded_tensor_metadata`) and
    Python objects, unpickled with pickle_policy's globals only (PickleRefused for any other).
    Raises pt_index.NotATorchFile, OSError, or what a damaged pickle raises."""
    # torch warns on every DeviceMesh unpickled without process groups; it is harmless here
    with quieted("torch.distributed.device_mesh"):
        return pt_tensors.load(path, pt_tensors.COPY)


def load_rank_file(path: str) -> dict:
    """torch.load(mmap=True) of one model file, with errors that say what is wrong with it."""
    if os.path.getsize(path) == 0:
        raise CheckpointError(
            f"{path} is empty (interrupted save?); re-copy it from the training run or merge an earlier global_step"
        )
    try:
        sd = load_mmap(path)
    except PickleRefused:
        raise
    except Exception as exc:  # noqa: BLE001 - torch raises many types for a damaged zip/pickle
        reason = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise CheckpointError(
            f"{path}: not a readable torch checkpoint ({reason[:160]}); it is truncated "
            f"or not a verl model shard: re-copy it from the training run"
        ) from None
    if not isinstance(sd, dict) or not all(isinstance(k, str) for k in sd):
        raise CheckpointError(
            f"{path}: holds a {type(sd).__name__}, not a model state dict; is this a "
            f"verl model_world_size_*_rank_*.pt file?"
        )
    if not any(isinstance(v, torch.Tensor) for v in sd.values()):
        raise CheckpointError(f"{path}: the state dict holds no tensors; not a verl model shard")
    return sd


def _dtensor_types() -> tuple[type, ...]:
    from torch.distributed.tensor import DTensor

    return (DTensor,)


def open_checkpoint(local_dir: str) -> VerlFsdpCheckpoint:
    """Validate `local_dir` and map every rank's model file; raises CheckpointError. (A merge opens
    its input through `merge_input.open_source`, which also reads an incremental-tier step.)"""
    local_dir = os.path.abspath(local_dir)
    world, version = read_fsdp_config(local_dir)
    paths = check_rank_files(local_dir, world)
    state_dicts = [load_rank_file(p) for p in paths]
    keys0 = list(state_dicts[0])
    for r, sd in enumerate(state_dicts[1:], start=1):
        if set(sd) != set(keys0):
            diff = sorted(set(sd) ^ set(keys0))
            raise CheckpointError(
                f"{paths[r]}: its keys differ from rank 0's (e.g. {diff[:3]}); the files "
                f"come from different models or runs: re-copy the checkpoint"
            )
    mesh = _find_mesh(state_dicts[0])
    ckpt = VerlFsdpCheckpoint(
        local_dir=local_dir, world_size=world, fsdp_version=version, state_dicts=state_dicts, tensors={}, mesh=mesh
    )
    plain_ranks = _plain_compare_ranks(mesh, world)
    for key in keys0:
        value = state_dicts[0][key]
        if not isinstance(value, torch.Tensor):
            ckpt.skipped.append(key)
            continue
        ckpt.tensors[key] = _source_tensor(ckpt, key, plain_ranks)
        ckpt.tensors[key].local_dir, ckpt.tensors[key].world_size = local_dir, world
    if ckpt.skipped:
        log.warning("skipping %d non-tensor entries of the state dict: %s", len(ckpt.skipped), ckpt.skipped[:5])
    return ckpt


def _find_mesh(sd: dict) -> MeshInfo | None:
    dtensor = _dtensor_types()
    # verl's merger takes the mesh of the alphabetically first key; any DTensor's mesh is the same
    for key in sorted(sd):
        v = sd[key]
        if isinstance(v, dtensor):
            m = v.device_mesh
            return MeshInfo(tuple(m.mesh_dim_names or ()), m.mesh.tolist())
    return None


def verl_reads_rank0_alone(ckpt: VerlFsdpCheckpoint) -> str | None:
    """The key that makes verl 0.9.1's FSDPModelMerger read rank 0's file alone, or None. It takes
    the device mesh from the alphabetically first key of rank 0's state dict; a plain tensor there (a
    parameter FSDP left unsharded, or a buffer whose name sorts first) gives it a mesh of one rank,
    and it then writes every sharded tensor as rank 0's rows, with no error."""
    if ckpt.world_size < 2 or not ckpt.state_dicts:
        return None
    first = min(ckpt.state_dicts[0])
    value = ckpt.state_dicts[0][first]
    plain = isinstance(value, torch.Tensor) and not isinstance(value, (*_dtensor_types(), ShardedTensorState))
    return first if plain else None


def _plain_compare_ranks(mesh: MeshInfo | None, world: int) -> list[int]:
    """Ranks whose copies of an unsharded tensor verl compares: rank 0's FSDP group."""
    if mesh is None:
        return list(range(world))
    mesh_t = torch.tensor(mesh.mesh)
    group = mesh_t.reshape(-1, mesh_t.shape[-1])[0] if mesh_t.ndim > 1 else mesh_t
    return [int(r) for r in group]


def _source_tensor(ckpt: VerlFsdpCheckpoint, key: str, plain_ranks: list[int]) -> SourceTensor:
    dtensor = _dtensor_types()
    v0 = ckpt.state_dicts[0][key]
    if isinstance(v0, dtensor):
        return _from_dtensor(ckpt, key)
    if isinstance(v0, ShardedTensorState):
        return _from_sharded_tensor(ckpt, key)
    pieces, ranks = [], []
    for r in plain_ranks:
        t = ckpt.state_dicts[r][key]
        if not isinstance(t, torch.Tensor) or type(t) is not type(v0) or t.shape != v0.shape:
            raise CheckpointError(
                f"{ckpt.model_file(r)}: entry {key!r} is {type(t).__name__} "
                f"{tuple(getattr(t, 'shape', ()))}, rank 0 has {tuple(v0.shape)}; "
                f"the files come from different runs"
            )
        pieces.append(t)
        ranks.append(r)
    return SourceTensor(key, tuple(v0.shape), v0.dtype, None, pieces, ranks)


def _from_dtensor(ckpt: VerlFsdpCheckpoint, key: str) -> SourceTensor:
    v0 = ckpt.state_dicts[0][key]
    placements = tuple(v0.placements)
    path0 = ckpt.model_file(0)
    if any(p.is_partial() for p in placements):
        raise CheckpointError(
            f"{path0}: {key!r} has a Partial placement {placements}, which no FSDP "
            f"checkpoint should hold; this checkpoint cannot be merged"
        )
    shard_mesh_dims = [i for i, p in enumerate(placements) if p.is_shard()]
    shape = tuple(v0.shape)
    if not shard_mesh_dims:
        # verl keeps rank 0's copy of a replicated DTensor without comparing
        local = v0._local_tensor
        return SourceTensor(key, shape, local.dtype, None, [local], [0], replicated_dtensor=True)
    if len(shard_mesh_dims) > 1:
        raise CheckpointError(
            f"{path0}: {key!r} is sharded on {len(shard_mesh_dims)} mesh dims "
            f"{placements} (FSDP + TP); only FSDP/HSDP checkpoints can be merged"
        )
    mesh_dim = shard_mesh_dims[0]
    dim = placements[mesh_dim].dim
    dim = dim + len(shape) if dim < 0 else dim
    mesh_t = v0.device_mesh.mesh
    if int(mesh_t.numel()) != ckpt.world_size:
        raise CheckpointError(
            f"{path0}: {key!r} lives on a mesh of {mesh_t.numel()} ranks but "
            f"{FSDP_CONFIG} says world size {ckpt.world_size}; the dir mixes two checkpoints"
        )
    # rank 0's coordinate on every other mesh dim, varying the sharded one
    coord0 = [int(c[0]) for c in (mesh_t == 0).nonzero(as_tuple=True)]
    ranks = []
    for k in range(mesh_t.shape[mesh_dim]):
        coord = list(coord0)
        coord[mesh_dim] = k
        ranks.append(int(mesh_t[tuple(coord)]))
    pieces = []
    for r in ranks:
        v = ckpt.state_dicts[r][key]
        if not isinstance(v, _dtensor_types()) or tuple(v.shape) != shape or tuple(v.placements) != placements:
            raise CheckpointError(
                f"{ckpt.model_file(r)}: entry {key!r} does not match rank 0's "
                f"(shape/placement); the files come from different runs"
            )
        pieces.append(v._local_tensor)
    total = sum(p.shape[dim] for p in pieces)
    if total != shape[dim]:
        raise CheckpointError(
            f"{ckpt.model_file(ranks[-1])}: shards of {key!r} add up to {total} rows "
            f"along dim {dim}, the tensor has {shape[dim]}; a rank file is damaged or stale"
        )
    return SourceTensor(key, shape, pieces[0].dtype, dim, pieces, ranks)


def _from_sharded_tensor(ckpt: VerlFsdpCheckpoint, key: str) -> SourceTensor:
    meta = ckpt.state_dicts[0][key]._slim_metadata
    shape = tuple(meta.size)
    by_offset = []
    for r in range(ckpt.world_size):
        st = ckpt.state_dicts[r][key]
        if not isinstance(st, ShardedTensorState):
            raise CheckpointError(
                f"{ckpt.model_file(r)}: entry {key!r} is not a ShardedTensor like rank 0's; the files come from "
                f"different runs: re-copy the checkpoint"
            )
        for shard in st._slim_local_shards:
            md = shard.metadata
            if any(o for o in md.shard_offsets[1:]) or tuple(md.shard_sizes[1:]) != shape[1:]:
                raise CheckpointError(
                    f"{ckpt.model_file(r)}: {key!r} is not sharded along dim 0 only; cannot be merged"
                )
            by_offset.append((md.shard_offsets[0], r, shard.tensor))
    by_offset.sort(key=lambda x: (x[0], x[1]))
    pieces, ranks, expect = [], [], 0
    for offset, r, t in by_offset:
        if offset != expect:
            raise CheckpointError(
                f"{ckpt.model_file(r)}: shards of {key!r} leave a gap or overlap at row "
                f"{expect}; a rank file is missing or stale"
            )
        pieces.append(t)
        ranks.append(r)
        expect += t.shape[0]
    if expect != (shape[0] if shape else 1):
        raise CheckpointError(
            f"{ckpt.local_dir}: shards of {key!r} cover {expect} of {shape[0]} rows; a rank file is missing or "
            f"stale: re-copy the checkpoint"
        )
    return SourceTensor(key, shape, pieces[0].dtype, 0, pieces, ranks)
