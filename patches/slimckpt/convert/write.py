"""The conversion itself (the command's arguments and messages are slimckpt.convert.command): every role
of a step opened memory-mapped (source), checked against the model its config describes, and written as
verl's rank files at M ranks, one rank file at a time over torch's fake process group (rank_file), its
extra state resharded (save.rng_reshard); then the side files, the commit and the tracker."""

from __future__ import annotations

import json
import os
import shutil
import sys
import time

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from tqdm import tqdm

from slimckpt import internals
from slimckpt.convert import rank_file
from slimckpt.convert.layout import meta_layout
from slimckpt.convert.plan import (
    ConvertError,
    Target,
    check_world_size,
    flat_runs,
    flat_shard,
    parse_step_dir,
    plan_target,
    row_range,
)
from slimckpt.convert.rank_file import FlatSource, Run
from slimckpt.convert.source import open_role
from slimckpt.engine.resume_records import write_tracker
from slimckpt.layout.resume_manifest import read_tracker
from slimckpt.log import get_logger
from slimckpt.save import rng_reshard
from slimckpt.storage import for_path

log = get_logger("slimckpt.convert")


def convert(
    step_dir: str, world: int, fsdp: int | None, target_dir: str | None, overwrite: bool, progress: bool = False
) -> tuple[Target, str]:
    """Convert every role of the step; returns the target and a one-line summary."""
    start = time.perf_counter()
    root, step, roles = parse_step_dir(step_dir)
    target = plan_target(root, step, world, target_dir, overwrite)
    sources = {role: open_role(os.path.join(root, f"global_step_{step}", role)) for role in roles}
    for src in sources.values():
        version = fsdp or src.fsdp_version or 2
        check_world_size(
            {n: tuple(t.shape) for n, t in src.model.items() if n not in src.plain},
            world,
            version,
            os.path.join(src.role_dir, "huggingface", "config.json"),
        )
        _check_model(src)
    store = for_path(target.partial_dir)
    store.remove_tree(target.partial_dir, ignore_errors=True)  # what a killed convert left
    store.make_dirs(target.partial_dir)
    written = 0
    total = sum(_tensor_bytes(src) for src in sources.values())
    bar = tqdm(
        total=total, unit="B", unit_scale=True, unit_divisor=1024, desc="convert", disable=not progress, file=sys.stderr
    )
    with FakeWorld(world) as mesh, bar:
        for role, src in sources.items():
            written += _write_role(
                src, os.path.join(target.partial_dir, role), world, fsdp or src.fsdp_version or 2, mesh, bar.update
            )
    data = os.path.join(root, f"global_step_{step}", "data.pt")
    if os.path.isfile(data):  # the dataloader's state, as verl's trainer saved it
        shutil.copy2(data, os.path.join(target.partial_dir, "data.pt"))
    _commit(target)
    tracker = _move_tracker(target)
    kinds = ", ".join(
        f"{role} ({src.kind} at {src.world} ranks, {'+'.join(src.contents)})" for role, src in sources.items()
    )
    return target, (
        f"converted {kinds} into {target.step_dir} at {world} ranks ({written / 2**20:.1f} MiB, "
        f"{time.perf_counter() - start:.1f} s); {tracker}; resume with unpatched verl: "
        f"trainer.default_local_dir={target.root} trainer.resume_mode=auto "
        f"trainer.n_gpus_per_node*trainer.nnodes={world}"
    )


HEADS = ("lm_head.", "score.")  # the causal LM's head, a critic's: the one part the two classes differ in


def _check_model(src) -> None:
    """The step's tensors against the model its huggingface/config.json describes (names, shapes),
    so rank files of another model are refused before anything is written."""
    config_path = os.path.join(src.hf_dir, "config.json")
    if not os.path.isfile(config_path):
        raise ConvertError(f"{config_path} is missing; the step's save did not finish: convert an earlier step")
    layout = src.layout or meta_layout(src.hf_dir)
    if layout is None:
        return  # a model class convert cannot build on the meta device: shapes were checked across ranks
    for name, shape in layout.shapes.items():
        if name in src.model and src.model[name].shape != shape:
            raise ConvertError(
                f"{src.model[name].where}: {name!r} is {list(src.model[name].shape)} but {config_path} "
                f"makes it {list(shape)}; the files come from another model: re-copy the step"
            )
    lora = any("lora_" in n for n in src.model)
    missing = [n for n in layout.shapes if n not in src.model and not n.startswith(HEADS)]
    if missing and not lora:
        first = next(iter(src.model.values()))
        raise ConvertError(
            f"{first.where}: holds no {missing[0]!r}, which {config_path} describes; the files come from "
            f"another model: re-copy the step"
        )


class FakeWorld:
    """torch's fake process group of `world` ranks and a 1-D ("fsdp",) mesh over it, as verl builds
    it: the DTensors written carry that mesh, so verl's load into its own mesh matches."""

    def __init__(self, world: int) -> None:
        self.world = world

    def __enter__(self):
        if dist.is_initialized():
            raise ConvertError(
                "slimckpt convert runs as one plain process, not under torchrun; run it without torchrun"
            )
        fake_store = internals.lookup("torch.testing._internal.distributed.fake_pg:FakeStore")
        if fake_store is None:  # torch has no public fake process group to fall back on
            raise ConvertError(
                f"slimckpt convert: torch {internals.release('torch')}'s fake process group is not one "
                f"slimckpt was checked on; {internals.TRUST_ENV}=1 tries it anyway"
            )
        dist.init_process_group("fake", store=fake_store(), rank=0, world_size=self.world)
        return init_device_mesh("cpu", (self.world,), mesh_dim_names=("fsdp",))

    def __exit__(self, *exc) -> None:
        dist.destroy_process_group()


def _tensor_bytes(src) -> int:
    """Bytes of tensors a convert of `src` writes (every rank's files together; FSDP1's padding aside)."""
    tensors = list(src.model.values()) + [v for p in src.optim for v in p.state.values() if isinstance(v, FlatSource)]
    return sum(sum(piece.numel() for piece in t.pieces) * t.pieces[0].element_size() for t in tensors if t.pieces)


def _write_role(src, out_dir: str, world: int, fsdp: int, mesh, on_bytes=None) -> int:
    os.makedirs(out_dir)
    total = 0
    order = target_order(src) if src.has_optim_file else ([], [])

    def count(n: int) -> None:
        nonlocal total
        total += n
        if on_bytes is not None:
            on_bytes(n)

    for rank in range(world):
        if "model" in src.contents:
            skel = rank_file.Skeleton(mesh)
            # FSDP1 on one rank runs NO_SHARD: its sharded state dict holds plain tensors
            unsharded = fsdp == 1 and world == 1
            obj = {
                name: (
                    skel.plain((name,), t)
                    if unsharded or name in src.plain or not t.shape
                    else skel.sharded((name,), t, row_range(t.shape[0], world, rank))
                )
                for name, t in src.model.items()
            }
            rank_file.write(os.path.join(out_dir, f"model_world_size_{world}_rank_{rank}.pt"), obj, skel, count)
        if src.has_optim_file:
            skel = rank_file.Skeleton(mesh)
            obj = (
                _fsdp1_optim(src, skel, order, world, rank)
                if fsdp == 1
                else _fsdp2_optim(src, skel, order, world, rank)
            )
            rank_file.write(os.path.join(out_dir, f"optim_world_size_{world}_rank_{rank}.pt"), obj, skel, count)
        if "extra" in src.contents:
            _write_extra(src, out_dir, world, rank)
        log.info("convert: %s rank %d of %d written", os.path.basename(src.role_dir), rank, world)
    _copy_side_files(src, out_dir, world, fsdp)
    return total


def target_order(src) -> tuple[list, list[dict]]:
    """The optimizer's parameters in the order the resuming optimizer numbers them, and its
    param_groups so numbered: verl builds it over `module.parameters()`, whose order an FSDP1 step
    (flat parameters, the root's first) does not keep. Where the names are not all known, or there
    are several groups, the saved numbering stays."""
    optim, groups = src.optim, src.param_groups
    names = [p.fqn for p in optim]
    if src.layout is None or None in names or len(groups) != 1:
        return optim, groups
    by_name = {p.fqn: p for p in optim}
    ordered = [n for n, _ in src.layout.params if n in by_name]
    if len(ordered) != len(optim):
        return optim, groups
    return [by_name[n] for n in ordered], [{**groups[0], "params": list(range(len(ordered)))}]


def _state_value(skel, path: tuple, value, world: int, rank: int):
    if isinstance(value, FlatSource):
        if value.shape:
            return skel.sharded(path, value, row_range(value.shape[0], world, rank))
        return skel.plain(path, value)  # the step count, the same on every rank
    return value


def _fsdp2_optim(src, skel, order, world: int, rank: int) -> dict:
    """verl's FSDP2 optimizer file: `optimizer.state_dict()`, each state tensor a DTensor of the rank's rows."""
    params, groups = order
    state = {}
    for index, param in enumerate(params):
        if param.state:
            state[index] = {k: _state_value(skel, ("state", index, k), v, world, rank) for k, v in param.state.items()}
    return {"state": state, "param_groups": [dict(g) for g in groups]}


def _fsdp1_optim(src, skel, order, world: int, rank: int) -> dict:
    """verl's FSDP1 optimizer file (use_orig_params=False, its default): one state entry per flat
    parameter, each tensor the rank's run of the parameters flattened one after another, padded."""
    params, groups = order
    layout = src.layout
    where = os.path.join(src.hf_dir, "config.json")
    if layout is None:
        raise ConvertError(
            f"{where}: no model could be built from it, so FSDP1's flat parameters are unknown; convert with --fsdp 2"
        )
    by_name = {p.fqn: p for p in params}
    missing = [f for unit in layout.units for f in unit if f not in by_name]
    if missing or len(groups) != 1:
        raise ConvertError(
            f"{src.role_dir}: the optimizer does not hold every parameter in one group (e.g. "
            f"{(missing or ['a second param_group'])[0]!r}), which FSDP1's flat parameters need; "
            f"convert with --fsdp 2"
        )
    state = {}
    for u, unit in enumerate(layout.units):
        with_state = [by_name[f] for f in unit if by_name[f].state]
        if not with_state:
            continue
        numels = [layout.numel(f) for f in unit]
        size = flat_shard(sum(numels), world)
        entry = {}
        for key, value in with_state[0].state.items():
            if isinstance(value, FlatSource) and value.shape:
                runs = [Run(at, by_name[unit[i]].state[key], a, b) for i, a, b, at in flat_runs(numels, world, rank)]
                entry[key] = skel.flat(("state", u, key), size, value.dtype, runs)
            else:
                entry[key] = _state_value(skel, ("state", u, key), value, world, rank)
        state[u] = entry
    return {"state": state, "param_groups": [{**groups[0], "params": list(range(len(layout.units)))}]}


def _write_extra(src, out_dir: str, world: int, rank: int) -> None:
    """verl's extra state of `rank`: the lr scheduler (the same on every rank) and the saved RNG of
    rank r % N; a rank the saved run did not have gets a stream derived from it (rng_reshard), as
    slimckpt's own resharded load does."""
    saved = src.extra(rank % src.world)
    rng = saved.get("rng")
    if rng is not None and rank >= src.world:
        rng = rng_reshard.derive_rng_state(rng, rank)
    path = os.path.join(out_dir, f"extra_state_world_size_{world}_rank_{rank}.pt")
    with open(path, "wb") as f:
        torch.save({"lr_scheduler": saved.get("lr_scheduler"), "rng": rng}, f)
        f.flush()
        for_path(path).sync_open(f)
    if rank == 0:
        message = rng_reshard.reshard_message(src.world, world)
        if message:
            log.info("convert: %s", message)


SKIP_SIDE = ("slimckpt_", "fsdp_config.json", "model_world_size_", "optim_world_size_", "extra_state_world_size_")


def _copy_side_files(src, out_dir: str, world: int, fsdp: int) -> None:
    """huggingface/ (config, tokenizer, any export), LoRA meta and the like as the step has them;
    fsdp_config.json as verl writes it, for the new world size."""
    for name in sorted(os.listdir(src.role_dir)):
        path = os.path.join(src.role_dir, name)
        if name == "dcp" or name.startswith(SKIP_SIDE) or name.startswith("."):
            continue
        if os.path.isdir(path):
            shutil.copytree(path, os.path.join(out_dir, name))
        else:
            shutil.copy2(path, os.path.join(out_dir, name))
    with open(os.path.join(out_dir, "fsdp_config.json"), "w") as f:
        json.dump({"FSDP_version": fsdp, "world_size": world}, f, indent=4)


def _commit(target: Target) -> None:
    """Put the finished `.partial` in place (an existing step moved aside first, under --overwrite)."""
    store = for_path(target.step_dir)
    store.sync_tree(target.partial_dir)
    old = f"{target.step_dir}.replaced.{os.getpid()}" if os.path.exists(target.step_dir) else None
    store.atomic_publish(target.partial_dir, target.step_dir, aside=old, durable=False)
    store.sync(target.root)
    if old:
        store.remove_tree(old, ignore_errors=True)


def _move_tracker(target: Target) -> str:
    if write_tracker(target.root, target.step) or read_tracker(target.root) == target.step:
        return f"{target.tracker} names step {target.step}"
    return (
        f"{target.tracker} still names step {read_tracker(target.root)}, a later one: resume this step with "
        f"trainer.resume_mode=resume_path trainer.resume_from_path={target.step_dir}"
    )
