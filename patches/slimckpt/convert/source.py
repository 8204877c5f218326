"""A committed step's role dir opened for `slimckpt convert`, memory-mapped: its model and optimizer
tensors as row-sharded sources (`read.sources.SourceTensor`), the optimizer's param_groups in
verl's numbered form, and each saved rank's extra state.

Two formats: slimckpt's incremental dcp/ (model and optimizer keyed by parameter name; the
optimizer's numbering is the order of its param_groups' names, the order the saving optimizer
held its parameters in, which is the order an optimizer built the same way numbers them) and
verl's own rank files (already numbered). Every file and record is read by the one `.pt` reader
(read.pt_index, tensors by read.pt_tensors) with read.pickle_policy's globals.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import MetadataIndex
from torch.distributed.tensor import DTensor

from slimckpt.convert.layout import ModelLayout, meta_layout
from slimckpt.convert.plan import ConvertError, flat_runs
from slimckpt.convert.rank_file import FlatSource
from slimckpt.engine import pt_tensors
from slimckpt.engine.checkpoint_dir import DCP_DIR, HF_SUBDIR, CheckpointError, read_fsdp_config
from slimckpt.engine.dcp_pickle import read_metadata
from slimckpt.engine.dcp_source import open_dcp
from slimckpt.engine.dcp_step import is_dcp_role_dir
from slimckpt.engine.safe_load import load_torch_file
from slimckpt.engine.verl_sources import load_mmap, open_checkpoint
from slimckpt.layout.resume_manifest import MANIFEST_NAME, UncommittedCheckpoint, check_committed

EXTRA_OURS = "slimckpt_extra_world_size_{world}_rank_{rank}.pt"  # save.extra_state.EXTRA_NAME
EXTRA_VERL = "extra_state_world_size_{world}_rank_{rank}.pt"
OPTIM_VERL = "optim_world_size_{world}_rank_{rank}.pt"
OPTIM_STATE = "optim.state."
OPTIM_GROUPS = "optim.param_groups."


@dataclass
class ParamState:
    """One parameter of the optimizer: its name where known, its state (tensors as FlatSource)."""

    fqn: str | None
    state: dict[str, Any]


@dataclass
class RoleSource:
    role_dir: str
    kind: str  # "slimckpt" or "verl"
    world: int
    fsdp_version: int | None
    contents: list[str]
    model: dict[str, FlatSource]
    plain: set[str]  # model entries that are plain tensors in verl's files, not DTensors
    layout: ModelLayout | None = None
    optim: list[ParamState] = field(default_factory=list)  # in the saving optimizer's numbering
    param_groups: list[dict[str, Any]] = field(default_factory=list)  # "params": [index into optim, ...]
    has_optim_file: bool = False

    @property
    def hf_dir(self) -> str:
        return os.path.join(self.role_dir, HF_SUBDIR)

    def extra_path(self, rank: int) -> str:
        name = EXTRA_OURS if self.kind == "slimckpt" else EXTRA_VERL
        return os.path.join(self.role_dir, name.format(world=self.world, rank=rank))

    def extra(self, rank: int) -> dict[str, Any]:
        path = self.extra_path(rank)
        if not os.path.isfile(path):
            raise ConvertError(
                f"{path} is missing: the step holds no extra state of rank {rank}; convert a step "
                f"saved with 'extra' in checkpoint.save_contents"
            )
        return load_torch_file(path, map_location="cpu")


def open_role(role_dir: str) -> RoleSource:
    """The role dir as convert's source; ConvertError/CheckpointError (one line) when it is not a
    committed, intact step."""
    if is_dcp_role_dir(role_dir):
        return _open_ours(role_dir)
    return _open_verl(role_dir)


# --------------------------------------------------------------------------- slimckpt's dcp/


def _open_ours(role_dir: str) -> RoleSource:
    try:  # committed, every file's size and checksum
        manifest = check_committed(role_dir, checksums=True)
    except UncommittedCheckpoint as exc:
        raise ConvertError(
            f"{str(exc).removeprefix('slimckpt: ')} (convert reads only a committed, intact step: "
            f"convert an earlier global_step_*)"
        ) from None
    if "model" not in manifest.contents:
        raise ConvertError(
            f"{os.path.join(role_dir, MANIFEST_NAME)}: this step was saved with contents "
            f"{manifest.contents}, without the model; convert a step saved with 'model'"
        )
    if manifest.extra.get("lora_only"):
        raise ConvertError(
            f"{os.path.join(role_dir, MANIFEST_NAME)}: saved with save_lora_only (the adapter, no base "
            f"weights); convert does not write LoRA-only steps yet"
        )
    model = {n: FlatSource.of(t) for n, t in open_dcp(role_dir, manifest).tensors.items()}
    layout = meta_layout(os.path.join(role_dir, HF_SUBDIR), set(model))
    src = RoleSource(
        role_dir,
        "slimckpt",
        manifest.world_size,
        manifest.fsdp_version,
        list(manifest.contents),
        model,
        set(layout.buffers) & set(model) if layout else set(),
        layout,
    )
    if "optimizer" not in manifest.contents:
        return src
    dcp_dir = os.path.join(role_dir, DCP_DIR)
    metadata = read_metadata(dcp_dir)
    groups = _param_groups(dcp_dir, metadata)
    tensors = open_dcp(role_dir, manifest, prefix=OPTIM_STATE).tensors
    per_param: dict[str, dict[str, Any]] = {}
    for key, tensor in tensors.items():
        fqn, _, state_key = key.rpartition(".")
        per_param.setdefault(fqn, {})[state_key] = FlatSource.of(tensor)
    index = 0
    for group in groups:
        names = list(group["params"])
        group["params"] = list(range(index, index + len(names)))
        for name in names:
            src.optim.append(ParamState(name, per_param.pop(name, {})))
            index += 1
    if per_param:
        raise ConvertError(
            f"{os.path.join(dcp_dir, '.metadata')}: optimizer state of {sorted(per_param)[0]!r}, a "
            f"parameter no param_group names; the step is damaged, convert an earlier one"
        )
    src.param_groups, src.has_optim_file = groups, True
    return src


def _param_groups(dcp_dir: str, metadata) -> list[dict[str, Any]]:
    """The optimizer's param_groups, as DCP saved them: one pickled value per `optim.param_groups.<i>.<key>`."""
    groups: dict[int, dict[str, Any]] = {}
    for key in metadata.state_dict_metadata:
        if not key.startswith(OPTIM_GROUPS):
            continue
        i, _, name = key[len(OPTIM_GROUPS) :].partition(".")
        info = metadata.storage_data[MetadataIndex(key)]
        path = os.path.join(dcp_dir, info.relative_path)
        with open(path, "rb") as f:
            f.seek(info.offset)
            data = f.read(info.length)
        groups.setdefault(int(i), {})[name] = pt_tensors.load_bytes(data, path)
    if not groups:
        raise ConvertError(
            f"{os.path.join(dcp_dir, '.metadata')}: the optimizer's param_groups are missing; the step "
            f"is damaged, convert an earlier one"
        )
    return [groups[i] for i in sorted(groups)]


# --------------------------------------------------------------------------- verl's rank files


def _open_verl(role_dir: str) -> RoleSource:
    world, version = read_fsdp_config(role_dir)
    ckpt = open_checkpoint(role_dir)
    rank0 = ckpt.state_dicts[0]
    plain = {
        name for name, value in rank0.items() if isinstance(value, torch.Tensor) and not isinstance(value, DTensor)
    }
    for name, tensor in ckpt.tensors.items():
        if name not in plain and tensor.shard_dim not in (0, None):
            raise ConvertError(
                f"{ckpt.model_file(0)}: {name!r} is sharded along dim {tensor.shard_dim}; convert "
                f"reads dim-0 shards only (verl's default placement)"
            )
    contents = ["model"]
    model = {n: FlatSource.of(t) for n, t in ckpt.tensors.items()}
    layout = meta_layout(os.path.join(role_dir, HF_SUBDIR), set(model))
    if version == 1 and world == 1:  # NO_SHARD: every parameter a plain tensor; only the buffers stay plain
        plain = set(layout.buffers) if layout else set()
    src = RoleSource(role_dir, "verl", world, version, contents, model, plain, layout)
    optim_paths = [os.path.join(role_dir, OPTIM_VERL.format(world=world, rank=r)) for r in range(world)]
    present = [os.path.isfile(p) for p in optim_paths]
    if any(present) and not all(present):
        missing = optim_paths[present.index(False)]
        raise ConvertError(
            f"{missing} is missing while other ranks' optimizer files are there; copy every rank's file into {role_dir}"
        )
    if all(present):
        per_rank = [load_rank_file_any(p) for p in optim_paths]
        src.param_groups = [dict(g) for g in per_rank[0].get("param_groups", [])]
        n_params = sum(len(g["params"]) for g in src.param_groups)
        params = [n for n, _ in src.layout.params] if src.layout else []
        if version == 1 and _is_flat(per_rank[0]):
            _split_flat(src, per_rank, optim_paths)
        else:
            state = _verl_optim_state(per_rank, optim_paths)
            names = params if len(params) == n_params else [None] * n_params
            src.optim = [ParamState(names[i], state.get(i, {})) for i in range(n_params)]
        src.has_optim_file = True
        contents.append("optimizer")
    if os.path.isfile(src.extra_path(0)):
        contents.append("extra")
    return src


def load_rank_file_any(path: str) -> dict:
    """An optimizer rank file, memory-mapped, with pickle_policy's globals."""
    try:
        sd = load_mmap(path)
    except CheckpointError:
        raise
    except Exception as exc:  # noqa: BLE001 - torch raises many types for a damaged zip/pickle
        reason = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        raise ConvertError(
            f"{path}: not a readable torch checkpoint ({reason[:160]}); it is truncated or damaged: "
            f"re-copy it from the training run"
        ) from None
    if not isinstance(sd, dict) or "state" not in sd or "param_groups" not in sd:
        raise ConvertError(f"{path}: not an optimizer state dict (no 'state'/'param_groups'); is it verl's optim file?")
    return sd


def _verl_optim_state(per_rank: list[dict], paths: list[str]) -> dict[int, dict[str, Any]]:
    out: dict[int, dict[str, Any]] = {}
    for index, state0 in per_rank[0]["state"].items():
        entry: dict[str, Any] = {}
        for key, value0 in state0.items():
            if isinstance(value0, DTensor):
                pieces = []
                for r, sd in enumerate(per_rank):
                    v = sd["state"].get(index, {}).get(key)
                    if not isinstance(v, DTensor) or tuple(v.shape) != tuple(value0.shape):
                        raise ConvertError(
                            f"{paths[r]}: optimizer state {index}.{key} does not match rank 0's; the "
                            f"files come from different runs"
                        )
                    pieces.append(v._local_tensor)
                if any(not p.is_shard(0) for p in value0.placements):
                    raise ConvertError(
                        f"{paths[0]}: optimizer state {index}.{key} is placed {value0.placements}; "
                        f"convert reads dim-0 shards only"
                    )
                entry[key] = FlatSource(tuple(value0.shape), value0.dtype, pieces, paths[0])
            elif isinstance(value0, torch.Tensor) and value0.dim() > 0:
                raise ConvertError(
                    f"{paths[0]}: optimizer state {index}.{key} is a plain {tuple(value0.shape)} tensor "
                    f"whose layout convert does not know (FSDP1 with use_orig_params=True?); only "
                    f"FSDP2's and FSDP1's default (flat) optimizer files are read"
                )
            elif isinstance(value0, torch.Tensor):
                entry[key] = FlatSource.of(value0, paths[0])
            else:
                entry[key] = value0
        out[int(index)] = entry
    return out


def _is_flat(sd: dict) -> bool:
    """An FSDP1 optimizer file of flat parameters: plain 1-D state tensors."""
    return any(
        isinstance(v, torch.Tensor) and v.dim() == 1 and type(v) is torch.Tensor
        for entry in sd["state"].values()
        for v in entry.values()
    )


def _split_flat(src: RoleSource, per_rank: list[dict], paths: list[str]) -> None:
    """FSDP1's flat optimizer shards at N ranks as per-parameter state: parameter p of flat
    parameter u is the run of u's elements it was flattened into, read from the ranks that hold it."""
    layout = src.layout
    if layout is None:
        raise ConvertError(
            f"{paths[0]}: FSDP1 flat optimizer shards, and no model could be built from "
            f"{os.path.join(src.hf_dir, 'config.json')} to tell which parameters they hold; copy the training "
            f"run's huggingface/ dir into the step's role dir"
        )
    groups = src.param_groups
    if len(groups) != 1 or len(groups[0]["params"]) != len(layout.units):
        raise ConvertError(
            f"{paths[0]}: {sum(len(g['params']) for g in groups)} flat parameters in "
            f"{len(groups)} param_groups, while verl's wrapping of this model makes {len(layout.units)}; "
            f"convert reads verl's default FSDP1 wrapping (one flat parameter per decoder layer)"
        )
    optim: list[ParamState] = []
    for u, unit in enumerate(layout.units):
        numels = [layout.numel(f) for f in unit]
        state0 = per_rank[0]["state"].get(u, {})
        per_param: list[dict[str, Any]] = [{} for _ in unit]
        for key, value0 in state0.items():
            if not isinstance(value0, torch.Tensor) or value0.dim() == 0:
                for d in per_param:
                    d[key] = FlatSource.of(value0, paths[0]) if isinstance(value0, torch.Tensor) else value0
                continue
            pieces: list[list[torch.Tensor]] = [[] for _ in unit]
            for k, sd in enumerate(per_rank):
                flat = sd["state"][u][key].reshape(-1)
                for i, a, b, at in flat_runs(numels, src.world, k):
                    pieces[i].append(flat[at : at + b - a])
            for i, fqn in enumerate(unit):
                per_param[i][key] = FlatSource(layout.shapes[fqn], value0.dtype, pieces[i], paths[0])
        optim += [ParamState(fqn, per_param[i]) for i, fqn in enumerate(unit)]
    src.optim = optim
    src.param_groups = [{**groups[0], "params": list(range(len(optim)))}]


def model_shapes(src: RoleSource) -> dict[str, tuple[int, ...]]:
    return {name: tuple(t.shape) for name, t in src.model.items()}


def manifest_path(role_dir: str) -> str:
    return os.path.join(role_dir, MANIFEST_NAME)
