#!/usr/bin/env python
"""One model's weights saved by a peer tool's own writer, on real ranks (torchrun, gloo, CPU).

  torchrun --standalone --nproc_per_node 2 -m scripts.bench.peers_save --tool dcp-hf --out DIR \
      --size-preset llama3.2-3b --dtype bfloat16
  torchrun ... -m scripts.bench.peers_save --tool torch-checkpointing --out DIR ...
  torchrun ... -m scripts.bench.peers_save --tool slimckpt-incremental --out DIR ...   # DIR/global_step_1/actor

The model is the fake-process-group builder's (slimckpt_testing.verl_checkpoints.fake_pg_checkpoint):
built on the meta device, wrapped with FSDP2 as verl wraps it, and only this rank's rows allocated and
filled (values that depend on the tensor's name and the element's position alone), so a merged
tensor can be checked against `expected_values` without the shards. Each rank holds its shards only.

  dcp-hf               torch.distributed.checkpoint.save with HuggingFaceStorageWriter(save_distributed=True):
                       per-rank safetensors shards with DCP's metadata, for consolidate_safetensors_files
  torch-checkpointing  torch_checkpointing.CheckpointManager, a sync save of item "model" as per-rank
                       safetensors with a resharder declared (so its metadata.pkl is written), for
                       torch_checkpointing.hf.consolidate_hf_safetensors_checkpoint
  slimckpt-incremental one step of slimckpt's incremental tier (save.step_save.save_resume_state, sync, no HF
                       export, [model, extra], no optimizer) with the files verl writes beside it
                       (fsdp_config.json, huggingface/config.json), in `incremental_role_dir(DIR)`, for
                       `slimckpt merge --local_dir` (its dcp/ files, committed by slimckpt_resume.json)

Rank 0 prints one JSON line: the tool, the parameters, the save's wall, the files' bytes.
"""

from __future__ import annotations

# lazy imports: torch and the tools only on the ranks (the CLI's --help and the index below are torch-free)
import argparse
import json
import os
import sys
import time

TOOLS = ("dcp-hf", "torch-checkpointing", "slimckpt-incremental")


def incremental_role_dir(out: str | os.PathLike) -> str:
    """Where --tool slimckpt-incremental puts its step under --out: a role dir as verl lays it out,
    what `slimckpt merge --local_dir` takes."""
    return os.path.join(out, "global_step_1", "actor")


def hf_file_index(names: list[str], files: int = 4) -> dict[str, int]:
    """Tensor name -> output file index 1..files, in state-dict order, files of about equal count:
    the same split for every tool (HF's own index is by bytes; the count is what the tools take)."""
    per = max(1, -(-len(names) // files))
    return {name: 1 + k // per for k, name in enumerate(names)}


def _save_dcp_hf(state: dict, out: str, index: dict[str, int]) -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import HuggingFaceStorageWriter

    writer = HuggingFaceStorageWriter(path=out, fqn_to_index_mapping=index, save_distributed=True)
    dcp.save(state, storage_writer=writer)


def _save_torch_checkpointing(state: dict, out: str) -> None:
    from torch_checkpointing import CheckpointManager, ItemSpec
    from torch_checkpointing.checkpoint_layout import LayoutInfo, SafetensorsSerialization
    from torch_checkpointing.default_resharder import DefaultResharder
    from torch_checkpointing.schema import RANK_PLACEHOLDER

    spec = ItemSpec(
        layout=LayoutInfo(f"model_{RANK_PLACEHOLDER}.safetensors", SafetensorsSerialization()),
        resharder=DefaultResharder(),
    )
    config = CheckpointManager.Config.with_sync_save()
    config.items = {"model": spec}
    manager = config.build()
    try:
        manager.save(out, {"model": state})  # a sync saver returns once the files are written
    finally:
        manager.close()


def _save_slimckpt_incremental(model, role_dir: str) -> None:
    import torch
    import torch.distributed as dist

    import slimckpt.save.modes.writer as resume_async
    from scripts.bench.s3_save import side_files
    from slimckpt.options.checkpoint_options import CheckpointOptions
    from slimckpt.save.step_save import save_resume_state
    from slimckpt.save.target import SaveTarget, TargetState, fsdp_version_of

    options = CheckpointOptions(
        recipe="incremental", incremental_save=True, async_save=False, measure=False, export_hf=False
    )
    state = TargetState()
    target = SaveTarget(
        model=model,
        optimizer=None,  # [model, extra] saves no optimizer: what the other tools save is the model alone
        options=options,
        state=state,
        rank=dist.get_rank(),
        world_size=dist.get_world_size(),
        save_contents=("model", "extra"),
        fsdp_version=fsdp_version_of(model),
        get_rng_state=torch.get_rng_state,
        load_rng_state=torch.set_rng_state,
        side_files=side_files(model.config),
    )
    save_resume_state(target, role_dir, 1)
    resume_async.writer_for(state).wait()  # sync returns committed already; a no-op kept for any other mode


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m scripts.bench.peers_save", description=__doc__.splitlines()[1])
    p.add_argument("--tool", choices=TOOLS, required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--size-preset", default="llama3.2-3b")
    p.add_argument("--dtype", choices=("float32", "bfloat16"), default="bfloat16")
    p.add_argument("--files", type=int, default=4, help="output files of the consolidated model")
    args = p.parse_args(argv)

    import torch.distributed as dist

    from slimckpt_testing.verl_checkpoints import fake_pg_checkpoint as fake

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    model_args = fake.parse_args(["--out", args.out, "--size-preset", args.size_preset, "--dtype", args.dtype])
    model = fake.build_sharded(model_args, world)
    state = model.state_dict()
    index = hf_file_index(list(state), args.files)
    dist.barrier()
    start = time.perf_counter()
    if args.tool == "dcp-hf":
        _save_dcp_hf(state, args.out, index)
    elif args.tool == "slimckpt-incremental":
        _save_slimckpt_incremental(model, incremental_role_dir(args.out))
    else:
        _save_torch_checkpointing(state, args.out)
    dist.barrier()
    wall = time.perf_counter() - start
    if rank == 0:
        files = [os.path.join(d, f) for d, _, fs in os.walk(args.out) for f in fs]
        print(
            json.dumps(
                {
                    "tool": args.tool,
                    "world_size": world,
                    "params": sum(p.numel() for p in model.parameters()),
                    "dtype": args.dtype,
                    "save_s": wall,
                    "bytes": sum(os.path.getsize(f) for f in files),
                    "files": len(files),
                    "index": index,
                }
            ),
            flush=True,
        )
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
