"""torchrun scenario (run by slimckpt_testing/scenarios/batch.py as `critic_save`) for tests/merge/test_merge_dcp.py: verl's
critic (a Qwen2 token classifier with one label, the value head `score`), FSDP2 on 2 ranks, one AdamW
step, then saved by verl's own FSDPCheckpointManager (verl/: its rank files) and by the incremental
tier without an export (incremental/: dcp/ only, as a critic always is). Rank 0 writes the model's own
full state dict (full_state.pt): what a merge of either must hold.
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist

import slimckpt_testing.scenarios.tiny_run as tiny_run  # the tiny model's sizes and the slimckpt config

# lazy imports: verl and slimckpt's save path load inside the scenario, after the batch set the module settings they read


def scenario(args) -> None:
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
    from torch.distributed.device_mesh import init_device_mesh
    from verl.trainer.config import CheckpointConfig
    from verl.utils.checkpoint.fsdp_checkpoint_manager import FSDPCheckpointManager

    from slimckpt_testing.verl_checkpoints.fsdp_checkpoint import auto_class, build_config, build_tokenizer, wrap_fsdp2

    torch.manual_seed(0)
    world = dist.get_world_size()
    model = auto_class("critic").from_config(build_config(tiny_run.tiny_args(), "critic"))
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("fsdp",))
    model = wrap_fsdp2(model, mesh, "dim0", world)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ids = torch.randint(0, tiny_run.VOCAB, (2, 12))
    model(input_ids=ids).logits.pow(2).mean().backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    manager = FSDPCheckpointManager(
        model,
        optimizer,
        None,
        processing_class=build_tokenizer(tiny_run.VOCAB),
        checkpoint_config=CheckpointConfig(save_contents=["model", "optimizer", "extra"]),
    )
    manager.save_checkpoint(os.path.join(args.dir, "verl", "global_step_1", "critic"), global_step=1)
    manager.checkpoint_config = tiny_run.slim_config(export_hf=False)
    manager.save_checkpoint(os.path.join(args.dir, "incremental", "global_step_1", "critic"), global_step=1)
    full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if dist.get_rank() == 0:
        torch.save({k: v.clone() for k, v in full.items()}, os.path.join(args.dir, "full_state.pt"))
    dist.barrier()
