"""`slimckpt convert <step dir> --to verl --world-size M`: a committed step written as verl 0.9.1's
own rank files at M ranks (model, optimizer, extra state), plus verl's tracker, so that verl
without slimckpt resumes it (`trainer.default_local_dir=<target>`, resume_mode=auto).

Reads slimckpt's incremental dcp/ steps and verl's own FSDP2 rank files at any N. Each rank's
files are written one tensor at a time from the memory-mapped source (rank_file), into
`<target>/global_step_N.partial`, renamed to `global_step_N` once every file is fsynced; only then
does the tracker move. A convert that is killed leaves a `.partial` dir that verl never looks at.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import time

from ..log import get_logger
from .plan import ConvertError, Target, check_world_size, parse_step_dir, plan_target, row_range

log = get_logger("slimckpt.convert")

HELP = "write a step (slimckpt's dcp/ or verl's rank files, at any world size) as verl's rank files at M ranks"
SHARD_FILES = ("model", "optim", "extra_state")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("step_dir", help="<trainer.default_local_dir>/global_step_N (its actor/ and critic/ are converted)")
    p.add_argument("--to", choices=["verl"], required=True, help="the format written: verl 0.9.1's rank files")
    p.add_argument("--world-size", "--world_size", dest="world_size", type=int, required=True,
                   help="ranks (GPUs) of the job that resumes it")
    p.add_argument("--fsdp", type=int, choices=[1, 2], default=None,
                   help="verl's actor.strategy: 2 for fsdp2 (default: the step's own)")
    p.add_argument("--target_dir", "--target-dir", dest="target_dir", default=None,
                   help="checkpoint root written (the resuming job's trainer.default_local_dir); "
                        "default: <source root>_verl_ws<M>")
    p.add_argument("--overwrite", action="store_true", help="replace the target's global_step_N if it exists")
    p.add_argument("--trust-pickle", "--trust_pickle", dest="trust_pickle", action="store_true",
                   help="unpickle any global the step's files name, as torch.load(weights_only=False) does (default: "
                        "only what verl and torch write; any other is refused before it runs); only for files from "
                        "someone you trust")


def run(args: argparse.Namespace) -> int:
    from ..read.checkpoint_dir import CheckpointError
    from ..read.pickle_policy import set_trusted

    set_trusted(args.trust_pickle)
    try:
        target, summary = convert(args.step_dir, args.world_size, args.fsdp, args.target_dir, args.overwrite)
    except (ConvertError, CheckpointError) as exc:
        line = str(exc).removeprefix("slimckpt: ")
        sys.stderr.write(f"slimckpt convert: error: {line}\n")
        sys.stderr.flush()
        return 1
    print(summary)
    return 0


def convert(step_dir: str, world: int, fsdp: int | None, target_dir: str | None, overwrite: bool) -> tuple[Target, str]:
    """Convert every role of the step; returns the target and a one-line summary."""
    from .source import open_role

    start = time.perf_counter()
    root, step, roles = parse_step_dir(step_dir)
    target = plan_target(root, step, world, target_dir, overwrite)
    sources = {role: open_role(os.path.join(root, f"global_step_{step}", role)) for role in roles}
    for role, src in sources.items():
        version = fsdp or src.fsdp_version or 2
        check_world_size({n: tuple(t.shape) for n, t in src.model.items() if n not in src.plain}, world, version,
                         os.path.join(src.role_dir, "huggingface", "config.json"))
        _check_model(src)
        if version == 1 and src.has_optim_file:
            raise ConvertError(f"{src.role_dir}: --fsdp 1 would need FSDP1's flat optimizer shards, which convert "
                               f"does not write; resume with actor_rollout_ref.actor.strategy=fsdp2 and --fsdp 2")
    shutil.rmtree(target.partial_dir, ignore_errors=True)  # what a killed convert left
    os.makedirs(target.partial_dir)
    written = 0
    with _fake_world(world) as mesh:
        for role, src in sources.items():
            written += _write_role(src, os.path.join(target.partial_dir, role), world, fsdp or src.fsdp_version or 2,
                                   mesh)
    data = os.path.join(root, f"global_step_{step}", "data.pt")
    if os.path.isfile(data):  # the dataloader's state, as verl's trainer saved it
        shutil.copy2(data, os.path.join(target.partial_dir, "data.pt"))
    _commit(target)
    tracker = _move_tracker(target)
    kinds = ", ".join(f"{role} ({src.kind} at {src.world} ranks, {'+'.join(src.contents)})"
                      for role, src in sources.items())
    return target, (f"converted {kinds} into {target.step_dir} at {world} ranks ({written / 2**20:.1f} MiB, "
                    f"{time.perf_counter() - start:.1f} s); {tracker}; resume with unpatched verl: "
                    f"trainer.default_local_dir={target.root} trainer.resume_mode=auto "
                    f"trainer.n_gpus_per_node*trainer.nnodes={world}")


def _check_model(src) -> None:
    """The step's tensors against the model its huggingface/config.json describes (names, shapes),
    so rank files of another model are refused before anything is written."""
    config_path = os.path.join(src.hf_dir, "config.json")
    if not os.path.isfile(config_path):
        raise ConvertError(f"{config_path} is missing; the step's save did not finish: convert an earlier step")
    expected = _expected_shapes(src.hf_dir)
    if expected is None:
        return
    names = {n for n in src.model if not n.startswith(("lora_", "base_model."))}
    known = {n: s for n, s in expected.items() if n in names}
    if not known:
        return  # a model class convert cannot build on the meta device (peft, a critic's head): names differ
    for name, shape in known.items():
        got = tuple(src.model[name].shape)
        if got != shape:
            where = src.model[name].file_of(0) if src.model[name].pieces else src.role_dir
            raise ConvertError(f"{where}: {name!r} is {list(got)} but {config_path} makes it {list(shape)}; the "
                               f"files come from another model: re-copy the step")


def _expected_shapes(hf_dir: str) -> dict[str, tuple[int, ...]] | None:
    try:
        import torch
        from transformers import AutoConfig, AutoModelForCausalLM

        config = AutoConfig.from_pretrained(hf_dir)
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config)
        return {n: tuple(t.shape) for n, t in model.state_dict().items()}
    except Exception as exc:  # noqa: BLE001 - a custom or non-causal model: checked by shapes across ranks only
        log.info("convert: no meta model from %s (%s); the shapes are checked across ranks only", hf_dir, exc)
        return None


class _fake_world:
    """torch's fake process group of `world` ranks and a 1-D ("fsdp",) mesh over it, as verl builds
    it: the DTensors written carry that mesh, so verl's load into its own mesh matches."""

    def __init__(self, world: int) -> None:
        self.world = world

    def __enter__(self):
        import torch.distributed as dist
        from torch.distributed.device_mesh import init_device_mesh
        from torch.testing._internal.distributed.fake_pg import FakeStore

        if dist.is_initialized():
            raise ConvertError("slimckpt convert runs as one plain process, not under torchrun")
        dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=self.world)
        return init_device_mesh("cpu", (self.world,), mesh_dim_names=("fsdp",))

    def __exit__(self, *exc) -> None:
        import torch.distributed as dist

        dist.destroy_process_group()


def _write_role(src, out_dir: str, world: int, fsdp: int, mesh) -> int:
    from . import rank_file

    os.makedirs(out_dir)
    total = 0

    def count(n: int) -> None:
        nonlocal total
        total += n

    for rank in range(world):
        if "model" in src.contents:
            skel = rank_file.Skeleton(mesh)
            obj = {name: (skel.plain((name,), t) if name in src.plain else
                          skel.sharded((name,), t, row_range(t.shape[0], world, rank)))
                   for name, t in src.model.items()}
            rank_file.write(os.path.join(out_dir, f"model_world_size_{world}_rank_{rank}.pt"), obj, skel, count)
        if src.has_optim_file:
            skel = rank_file.Skeleton(mesh)
            state = {}
            for index, entry in src.optim_state.items():
                state[index] = {}
                for key, value in entry.items():
                    path = ("state", index, key)
                    if hasattr(value, "pieces") and len(value.shape) > 0:
                        state[index][key] = skel.sharded(path, value, row_range(value.shape[0], world, rank))
                    elif hasattr(value, "pieces") or hasattr(value, "dtype"):
                        state[index][key] = skel.plain(path, value)  # the step count, the same on every rank
                    else:
                        state[index][key] = value
            obj = {"state": state, "param_groups": [dict(g) for g in src.param_groups]}
            rank_file.write(os.path.join(out_dir, f"optim_world_size_{world}_rank_{rank}.pt"), obj, skel, count)
        if "extra" in src.contents:
            _write_extra(src, out_dir, world, rank)
        log.info("convert: %s rank %d of %d written", os.path.basename(src.role_dir), rank, world)
    _copy_side_files(src, out_dir, world, fsdp)
    return total


def _write_extra(src, out_dir: str, world: int, rank: int) -> None:
    """verl's extra state of `rank`: the lr scheduler (the same on every rank) and the saved RNG of
    rank r % N; a rank the saved run did not have gets a stream derived from it (rng_reshard), as
    slimckpt's own resharded load does."""
    import torch

    from ..save import rng_reshard

    saved = src.extra(rank % src.world)
    rng = saved.get("rng")
    if rng is not None and rank >= src.world:
        rng = rng_reshard.derive_rng_state(rng, rank)
    path = os.path.join(out_dir, f"extra_state_world_size_{world}_rank_{rank}.pt")
    with open(path, "wb") as f:
        torch.save({"lr_scheduler": saved.get("lr_scheduler"), "rng": rng}, f)
        f.flush()
        os.fsync(f.fileno())
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


def _fsync_tree(top: str) -> None:
    from ..format.merge_manifest import fsync_path

    for dirpath, _dirs, files in os.walk(top):
        for name in files:
            fd = os.open(os.path.join(dirpath, name), os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        fsync_path(dirpath)


def _commit(target: Target) -> None:
    """Rename the finished `.partial` into place (an existing step moved aside first, under --overwrite)."""
    from ..format.merge_manifest import fsync_path

    _fsync_tree(target.partial_dir)
    old = None
    if os.path.exists(target.step_dir):
        old = f"{target.step_dir}.replaced.{os.getpid()}"
        os.replace(target.step_dir, old)
    os.replace(target.partial_dir, target.step_dir)
    fsync_path(target.root)
    if old:
        shutil.rmtree(old, ignore_errors=True)


def _move_tracker(target: Target) -> str:
    from ..format.resume_manifest import read_tracker, write_tracker

    if write_tracker(target.root, target.step):
        return f"{target.tracker} names step {target.step}"
    return (f"{target.tracker} still names step {read_tracker(target.root)}, a later one: resume this step with "
            f"trainer.resume_mode=resume_path trainer.resume_from_path={target.step_dir}")
