"""verl FSDP checkpoints made in one process, without torchrun: every rank file holds the whole state dict of
a tiny Llama as plain tensors (what FSDP stores for anything it does not shard). For the merge tests and
`make faults`' environment campaign (scripts/faults/env.py)."""

from __future__ import annotations

import json
from pathlib import Path

import torch

# lazy imports: transformers loads when a checkpoint is built, not when this module is imported


def tiny_llama_config(**overrides):
    from transformers import LlamaConfig

    kw = dict(
        vocab_size=96,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        architectures=["LlamaForCausalLM"],
        bos_token_id=1,
        eos_token_id=2,
        tie_word_embeddings=False,
    )
    kw.update(overrides)
    return LlamaConfig(**kw)


def synthetic_checkpoint(
    root: Path, world_size: int = 1, config=None, extra: dict | None = None, per_rank_edit=None
) -> Path:
    """A checkpoint dir verl's merger accepts, made without torchrun: every rank holds the whole
    state dict as plain tensors (what FSDP stores for anything it does not shard)."""
    from transformers import AutoModelForCausalLM

    config = config or tiny_llama_config()
    torch.manual_seed(0)
    sd = AutoModelForCausalLM.from_config(config).state_dict()
    sd = {k: v.detach().clone() for k, v in sd.items()}
    sd.update(extra or {})
    root.mkdir(parents=True, exist_ok=True)
    for r in range(world_size):
        rank_sd = {k: v.clone() for k, v in sd.items()}
        if per_rank_edit:
            per_rank_edit(r, rank_sd)
        torch.save(rank_sd, root / f"model_world_size_{world_size}_rank_{r}.pt")
    (root / "fsdp_config.json").write_text(json.dumps({"FSDP_version": 2, "world_size": world_size}))
    config.save_pretrained(root / "huggingface")
    return root
