"""The tiny run every multi-rank scenario trains and saves: a tiny model (a Llama, a Qwen2 with tied
embeddings, or one of the mixture-of-experts families) wrapped by FSDP2 or FSDP1 on the process group,
AdamW, a warm-up scheduler and verl's real FSDPCheckpointManager (`Run`); the incremental tier's config
(`slim_config`), the bitwise comparison of two states (`tensors_equal`) and a scenario's result file on
rank 0 (`write_result`). A scenario sets the switches below (MODEL, FSDP_VERSION, PLACEMENT, LORA_RANK)
on this module before it builds a Run."""

from __future__ import annotations

import json
import os
from types import SimpleNamespace

import torch
import torch.distributed as dist

# lazy imports: verl, transformers and slimckpt's save path load inside a Run, after the scenario set the
# switches and module settings they read
VOCAB, STEPS_BEFORE, STEPS_AFTER, SAVE_STEP = 64, 3, 3, 3


MODEL = "llama"  # --model qwen2-tied: tied embeddings (lm_head.weight is embed_tokens.weight)
FSDP_VERSION = 2  # --fsdp 1: FullyShardedDataParallel (verl's strategy=fsdp)
PLACEMENT = "dim0"  # FSDP2: "divisible" shards each parameter on its first dim divisible by the world size
LORA_RANK = 0  # > 0: the model wrapped by peft (LoRA of this rank, alpha 2r, on q_proj/v_proj), as verl's actor


def tiny_args():
    # experts: routed experts of the mixture-of-experts families (3 over 2 ranks: uneven shards)
    return SimpleNamespace(
        model=MODEL, vocab=VOCAB, hidden=32, intermediate=64, layers=2, heads=4, kv_heads=2, experts=3
    )


class Run:
    """Model, optimizer, scheduler and verl's checkpoint manager on this process group."""

    def __init__(self, seed: int, ckpt_config) -> None:
        from torch.distributed.device_mesh import init_device_mesh
        from transformers import AutoModelForCausalLM

        from slimckpt_testing.verl_checkpoints.fsdp_checkpoint import (
            build_config,
            training_state,
            wrap_fsdp1,
            wrap_fsdp2,
        )

        torch.manual_seed(seed)
        world = dist.get_world_size()
        model = AutoModelForCausalLM.from_config(build_config(tiny_args()))
        if LORA_RANK:
            from peft import LoraConfig, get_peft_model

            model = get_peft_model(
                model,
                LoraConfig(
                    r=LORA_RANK, lora_alpha=2 * LORA_RANK, task_type="CAUSAL_LM", target_modules=["q_proj", "v_proj"]
                ),
            )
        mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("fsdp",))
        self.model = wrap_fsdp2(model, mesh, PLACEMENT, world) if FSDP_VERSION == 2 else wrap_fsdp1(model, mesh)
        self.optimizer, self.scheduler, self.manager = training_state(self.model, ckpt_config, VOCAB)

    def step(self) -> float:
        # data from the global RNG, so the RNG state in extra matters for an exact resume
        ids = torch.randint(0, VOCAB, (2, 12))
        loss = self.model(input_ids=ids, labels=ids).loss
        loss.backward()
        self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        return float(loss.detach())

    def full_state(self) -> dict:
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions,
            get_model_state_dict,
            get_optimizer_state_dict,
        )

        opts = StateDictOptions(full_state_dict=True, cpu_offload=True)
        return {
            "model": get_model_state_dict(self.model, options=opts),
            "optim": get_optimizer_state_dict(self.model, self.optimizer, options=opts),
            "scheduler": self.scheduler.state_dict(),
        }


def slim_config(**kw):
    from slimckpt.verl.checkpoint_config import SlimCheckpointConfig

    return SlimCheckpointConfig(recipe="incremental", incremental_save=True, measure=False, **kw)


def tensors_equal(a, b, path="") -> list[str]:
    """Paths where two nested state dicts differ (bitwise for tensors)."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        same = (
            isinstance(a, torch.Tensor)
            and isinstance(b, torch.Tensor)
            and a.dtype == b.dtype
            and a.shape == b.shape
            and torch.equal(a, b)
        )
        return [] if same else [path]
    if isinstance(a, dict) and isinstance(b, dict):
        if set(a) != set(b):
            return [f"{path}: keys {sorted(set(a) ^ set(b))[:4]}"]
        return [d for k in a for d in tensors_equal(a[k], b[k], f"{path}.{k}")]
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        if len(a) != len(b):
            return [f"{path}: len"]
        return [d for i, (x, y) in enumerate(zip(a, b)) for d in tensors_equal(x, y, f"{path}[{i}]")]
    return [] if a == b else [f"{path}: {a!r} != {b!r}"]


def write_result(args, name: str, result: dict) -> None:
    if dist.get_rank() == 0:
        with open(os.path.join(args.dir, f"{name}_result.json"), "w") as f:
            json.dump(result, f, indent=1)
