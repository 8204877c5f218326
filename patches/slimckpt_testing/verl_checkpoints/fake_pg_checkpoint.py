"""Write a verl FSDP2 checkpoint of any size without ever holding the model.

    python -m slimckpt_testing.verl_checkpoints.fake_pg_checkpoint --out /data/ckpt/actor --world-size 8 \
        --size-preset llama3-8b [--save-contents model] [--ranks 0,1]
    python -m slimckpt_testing.verl_checkpoints.fake_pg_checkpoint --out /tmp/g4/actor --world-size 64 --model gemma4 \
        --replicate '*norm.weight'      # norms left unsharded, beside Gemma4's persistent buffers

torch's fake process group (backend "fake") lets one process act as rank r of N: collectives
return at once and move no data. For each rank in turn the model is built on the meta device,
wrapped as verl wraps it (`fully_shard` on every decoder layer, then the root), and `to_empty`
allocates only that rank's rows; they are filled with values that depend only on the tensor's
name and each element's position in the full tensor, and verl's own `FSDPCheckpointManager`
saves them. The files are the ones verl's trainer writes at that world size, and a reader can
check any merged tensor against `expected_values` without the shards. Peak memory is one rank's
shards (the model's bytes / N) per rank written at once (`--jobs`).

Under torchrun with `--materialize`, every rank builds the whole model on the host first (as
`slimckpt_testing.verl_checkpoints.fsdp_checkpoint` does) and fills its shards the same way, over a real process
group: the reference the fake-group files are tested against.
"""

# lazy imports: torch, transformers and verl only when a checkpoint is built (`--help`, the presets torch-free)
from __future__ import annotations

import argparse
import fnmatch
import json
import os
import sys
import time
import traceback
import zlib
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

from slimckpt import internals
from slimckpt.internals import dtensor_box
from slimckpt_testing.verl_checkpoints.fsdp_checkpoint import (
    DENSE_MODELS,
    PRESETS,
    auto_class,
    build_config,
    build_tokenizer,
    wrap_fsdp2,
)

# Values repeat with this period (a prime, so no row length of a real model divides it): a
# tensor's element at flat index i holds TABLE[(i + shift(name)) % PERIOD], and filling a block
# is copying windows of one small table, at memory speed, however large the model.
PERIOD = 999_983
FILL_CHUNK = 1 << 24  # elements per step of the general (non-contiguous block) path

_TABLE: dict[str, object] = {}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m slimckpt_testing.verl_checkpoints.fake_pg_checkpoint",
        description="Save a verl FSDP2 checkpoint of any size, one rank at a time, with torch's fake process group.",
    )
    p.add_argument("--out", required=True, help="checkpoint dir to write (verl's <step>/actor)")
    p.add_argument("--world-size", type=int, default=None, help="ranks to act as (default: torchrun's, else 2)")
    p.add_argument("--ranks", default=None, help="comma separated ranks to write (default: all)")
    p.add_argument("--model", choices=sorted(DENSE_MODELS), default="llama")
    p.add_argument(
        "--replicate",
        default="",
        help="comma separated parameter names (fnmatch patterns) FSDP leaves unsharded (fully_shard's "
        "ignored_params): every rank saves them whole as plain tensors, as it saves buffers",
    )
    p.add_argument("--size-preset", choices=sorted(PRESETS), default="tiny")
    for name in ("layers", "hidden", "intermediate", "vocab", "heads", "kv-heads"):
        p.add_argument(f"--{name}", type=int, default=None, help="overrides the preset")
    p.add_argument(
        "--save-contents",
        default="model",
        help="verl checkpoint.save_contents, comma separated (model, optimizer, extra)",
    )
    p.add_argument("--step", type=int, default=0, help="global_step given to save_checkpoint")
    p.add_argument(
        "--optimizer-state",
        dest="optimizer_state",
        action="store_true",
        help="give AdamW state (step 1, both moments filled like the weights) instead of none, so the "
        "optimizer files are full size",
    )
    p.add_argument("--no-tokenizer", action="store_true", help="save no tokenizer in huggingface/")
    p.add_argument(
        "--dtype",
        choices=("float32", "bfloat16"),
        default="float32",
        help="the parameters' dtype, so the files' (a bf16 model is saved as bf16 by verl's manager)",
    )
    p.add_argument("--jobs", type=int, default=1, help="ranks written at once (each holds its own shards)")
    p.add_argument(
        "--materialize",
        action="store_true",
        help="under torchrun (gloo): build the whole model on every rank, over the real process group",
    )
    args = p.parse_args(argv)
    preset = PRESETS[args.size_preset]
    for name, value in zip(("layers", "hidden", "intermediate", "vocab", "heads", "kv_heads"), preset):
        if getattr(args, name) is None:
            setattr(args, name, value)
    return args


def _table(dtype):
    """TABLE twice over, so that any window of up to PERIOD values is one contiguous slice: each
    value a hash of its index, a multiple of 2**-16 in [-0.5, 0.5) (fp32 holds it exactly)."""
    import torch

    key = str(dtype)
    if key not in _TABLE:
        h = torch.arange(PERIOD, dtype=torch.int64) * 0x9E3779B1 + 0x2545F491
        h = torch.bitwise_xor(h, torch.bitwise_right_shift(h, 17)) * 0x85EBCA6B
        h = torch.bitwise_xor(h, torch.bitwise_right_shift(h, 13))
        table = (h & 0xFFFF).to(dtype) / 65536.0 - 0.5
        _TABLE[key] = torch.cat([table, table])
    return _TABLE[key]


def _shift(name: str) -> int:
    return zlib.crc32(name.encode()) % PERIOD


def _fill_run(name: str, out, first: int) -> None:
    """`out` (1-D) := the values of tensor `name` at flat indices first, first + 1, ..."""
    table = _table(out.dtype)
    pos, done = (first + _shift(name)) % PERIOD, 0
    while done < out.numel():
        n = min(PERIOD - pos, out.numel() - done)
        out[done : done + n].copy_(table[pos : pos + n])
        done, pos = done + n, 0


def expected_values(name: str, shape, dtype=None):
    """The full tensor `name` of the given shape as the builder fills it (a checker's reference)."""
    import torch

    out = torch.empty(tuple(shape), dtype=dtype or torch.float32)
    _fill_run(name, out.view(-1), 0)
    return out


def fill_local(name: str, local, global_shape, global_offset) -> None:
    """Fill `local`, the block of the full tensor `name` starting at `global_offset`, in place."""
    import torch

    if local.numel() == 0:
        return
    gstride = [1] * len(global_shape)
    for d in range(len(global_shape) - 2, -1, -1):
        gstride[d] = gstride[d + 1] * global_shape[d + 1]
    first = sum(o * st for o, st in zip(global_offset, gstride))
    if tuple(local.shape[1:]) == tuple(global_shape[1:]) and local.is_contiguous():
        _fill_run(name, local.view(-1), first)  # whole rows: one run of the full tensor (FSDP2's dim-0 shards)
        return
    inner = torch.zeros((), dtype=torch.int64)
    for d in range(1, local.dim()):  # flat offsets of one row of the block, in the full tensor
        axis = (torch.arange(local.shape[d], dtype=torch.int64) + global_offset[d]) * gstride[d]
        inner = inner.unsqueeze(-1) + axis
    inner = inner.reshape(-1)
    rows_per_step = max(1, FILL_CHUNK // max(1, inner.numel()))
    flat = local.view(local.shape[0], -1)
    table = _table(local.dtype)
    for start in range(0, local.shape[0], rows_per_step):
        stop = min(local.shape[0], start + rows_per_step)
        rows = (torch.arange(start, stop, dtype=torch.int64) + global_offset[0]) * gstride[0]
        index = (rows.unsqueeze(1) + inner.unsqueeze(0) + _shift(name)) % PERIOD
        flat[start:stop].copy_(table[index])


def fill_model(model) -> None:
    """Every parameter and persistent buffer of an FSDP2 model, filled on this rank's rows; a tensor
    under two names (tied embeddings) is filled once, as its first name in the state dict."""
    import torch
    from torch.distributed.tensor import DTensor

    seen: set[int] = set()
    with torch.no_grad():
        for name, tensor in model.state_dict(keep_vars=True).items():
            if id(tensor) in seen:
                continue
            seen.add(id(tensor))
            if isinstance(tensor, DTensor):
                _, offset = dtensor_box(tensor)
                fill_local(name, tensor.to_local(), tuple(tensor.shape), tuple(offset))
            elif tensor.is_floating_point():
                fill_local(name, tensor, tuple(tensor.shape), (0,) * tensor.dim())


def build_sharded(args: argparse.Namespace, world_size: int, materialize: bool = False):
    """The model of `args` wrapped with FSDP2 over the current process group, its shards filled."""
    import torch
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (world_size,), mesh_dim_names=("fsdp",))
    config = build_config(args, args.model)
    dtype = getattr(torch, getattr(args, "dtype", "float32"))
    if materialize:
        model = auto_class(args.model).from_config(config, dtype=dtype)
    else:
        with torch.device("meta"):
            model = auto_class(args.model).from_config(config, dtype=dtype)
    wrap_fsdp2(model, mesh, "dim0", world_size, replicated_params(model, args.replicate))
    if not materialize:
        model.to_empty(device="cpu")  # non-persistent buffers (rotary) stay unset: nothing saves them
    fill_model(model)
    return model


def replicated_params(model: torch.nn.Module, patterns: str) -> set[torch.nn.Parameter]:
    """The parameters `--replicate` names (fnmatch patterns, comma separated); one that matches
    nothing is an error, so a misspelt name cannot leave the checkpoint without replicated tensors."""
    wanted = [p for p in patterns.split(",") if p]
    named = list(model.named_parameters(remove_duplicate=False))
    for pattern in wanted:
        if not any(fnmatch.fnmatchcase(name, pattern) for name, _ in named):
            raise SystemExit(f"--replicate: {pattern!r} matches no parameter of the model")
    return {p for name, p in named if any(fnmatch.fnmatchcase(name, pattern) for pattern in wanted)}


def save_rank(
    args: argparse.Namespace, world_size: int, tokenizer=None, materialize: bool = False, expect_rank: int | None = None
) -> int:
    """This process's rank of the checkpoint, saved by verl's manager; returns the model's parameters."""
    import torch
    from omegaconf import OmegaConf
    from torch.distributed.tensor import DTensor
    from verl.utils.checkpoint.fsdp_checkpoint_manager import FSDPCheckpointManager

    model = build_sharded(args, world_size, materialize)
    if expect_rank is not None:  # a mesh of another rank would silently write that rank's rows
        wrong = {tuple(p.device_mesh.get_coordinate() or ()) for p in model.parameters() if isinstance(p, DTensor)} - {
            (expect_rank,)
        }
        if wrong:
            raise RuntimeError(f"rank {expect_rank}: FSDP placed shards at mesh coordinate(s) {sorted(wrong)}")
    n_params = sum(p.numel() for p in model.parameters())
    contents = [c for c in args.save_contents.split(",") if c]
    optimizer = scheduler = None
    if "optimizer" in contents or "extra" in contents:  # verl's --steps 0 state: AdamW with no step taken
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
        if getattr(args, "optimizer_state", False):
            _fill_optimizer(model, optimizer)
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
    ckpt_cfg = OmegaConf.create({"save_contents": contents, "load_contents": contents})
    manager = FSDPCheckpointManager(
        model=model, optimizer=optimizer, lr_scheduler=scheduler, processing_class=tokenizer, checkpoint_config=ckpt_cfg
    )
    manager.save_checkpoint(local_path=args.out, global_step=args.step)
    return n_params


def _fill_optimizer(model, optimizer) -> None:
    """AdamW state after one step, for every parameter: the moments are DTensors like their
    parameter, filled as tensors named `<param>.exp_avg` / `.exp_avg_sq` would be."""
    import torch
    from torch.distributed.tensor import DTensor

    with torch.no_grad():
        for name, p in model.named_parameters():
            state = {"step": torch.tensor(1.0)}
            for key in ("exp_avg", "exp_avg_sq"):
                t = torch.empty_like(p)
                if isinstance(t, DTensor):
                    _, offset = dtensor_box(t)
                    fill_local(f"{name}.{key}", t.to_local(), tuple(t.shape), tuple(offset))
                else:
                    fill_local(f"{name}.{key}", t, tuple(t.shape), (0,) * t.dim())
                state[key] = t
            optimizer.state[p] = state


def _write_rank(args: argparse.Namespace, world_size: int, rank: int) -> int:
    import torch.distributed as dist

    start = time.perf_counter()
    fake_store = internals.lookup("torch.testing._internal.distributed.fake_pg:FakeStore")
    if fake_store is None:  # torch has no public fake process group to fall back on
        raise SystemExit(
            f"fake_pg_checkpoint: torch {internals.release('torch')}'s fake process group is not one "
            f"slimckpt was checked on; {internals.TRUST_ENV}=1 tries it anyway"
        )
    dist.init_process_group("fake", store=fake_store(), rank=rank, world_size=world_size)
    try:
        tokenizer = None if args.no_tokenizer else build_tokenizer(args.vocab)
        n_params = save_rank(args, world_size, tokenizer, expect_rank=rank)
    finally:
        dist.destroy_process_group()
    print(
        f"[fake_pg_checkpoint] rank {rank}/{world_size} written in {time.perf_counter() - start:.1f} s",
        file=sys.stderr,
        flush=True,
    )
    return n_params


def write_fake(args: argparse.Namespace, world_size: int, ranks: list[int], jobs: int = 1) -> int:
    """Each of `ranks` in a child forked from this process (torch, transformers and verl imported
    once), at most `jobs` at a time. One child per rank because DTensor's dispatch caches, keyed by
    meshes that compare equal across ranks, would hand a later rank the first rank's mesh."""
    import torch  # noqa: F401 - imported before the fork, once for every rank
    import transformers  # noqa: F401
    import verl.utils.checkpoint.fsdp_checkpoint_manager  # noqa: F401

    if len(ranks) == 1:
        return _write_rank(args, world_size, ranks[0])
    running: dict[int, int] = {}
    failed: list[int] = []

    def reap() -> None:
        pid, status = os.wait()
        rank = running.pop(pid)
        if os.waitstatus_to_exitcode(status) != 0:
            failed.append(rank)

    for rank in ranks:
        while len(running) >= max(1, jobs):
            reap()
        pid = os.fork()
        if pid == 0:  # the child writes its rank and leaves without running the parent's exit handlers
            code = 1
            try:
                _write_rank(args, world_size, rank)
                code = 0
            except BaseException:  # noqa: BLE001 - reported here, the parent names the rank
                traceback.print_exc()
            finally:
                sys.stdout.flush()
                sys.stderr.flush()
                os._exit(code)
        running[pid] = rank
    while running:
        reap()
    if failed:
        raise SystemExit(f"[fake_pg_checkpoint] rank(s) {sorted(failed)} failed (see above); {args.out} is incomplete")
    return param_count(args)


def param_count(args: argparse.Namespace) -> int:
    """The model's parameters, counted on the meta device."""
    import torch

    with torch.device("meta"):
        model = auto_class(args.model).from_config(build_config(args, args.model), dtype=torch.float32)
    return sum(p.numel() for p in model.parameters())


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.materialize:
        import torch.distributed as dist

        dist.init_process_group("gloo")
        world = dist.get_world_size()
        tokenizer = None if args.no_tokenizer else build_tokenizer(args.vocab)
        n_params = save_rank(args, world, tokenizer, materialize=True)
        dist.barrier()
        rank = dist.get_rank()
        dist.destroy_process_group()
        if rank:
            return 0
    else:
        world = args.world_size or int(os.environ.get("WORLD_SIZE", "2"))
        ranks = [int(r) for r in args.ranks.split(",")] if args.ranks else list(range(world))
        bad = [r for r in ranks if not 0 <= r < world]
        if bad:
            raise SystemExit(f"--ranks: rank {bad[0]} is outside world size {world}")
        n_params = write_fake(args, world, ranks, args.jobs)
    print(
        json.dumps(
            {
                "out": os.path.abspath(args.out),
                "model": args.model,
                "world_size": world,
                "params": n_params,
                "fsdp_version": 2,
                "mesh": "1d",
            }
        )
    )
    return 0


if __name__ == "__main__":
    from slimckpt.log import cli_logging

    with cli_logging():
        sys.exit(main())
