"""The plan wing's shared config: a 2-layer Llama worked out by hand, and the options `slimckpt plan` parses."""

from __future__ import annotations

import argparse

# a 2-layer Llama: vocab 1000, hidden 64, intermediate 128, 4 heads, 2 kv heads (head_dim 16)
TINY = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "vocab_size": 1000,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 256,
    "tie_word_embeddings": False,
}
PER_LAYER = 64 * 64 + 2 * (64 * 32) + 64 * 64 + 3 * 64 * 128 + 2 * 64  # q, k+v, o, mlp, 2 norms
PARAMS = 1000 * 64 + 2 * PER_LAYER + 64 + 1000 * 64  # embed, layers, final norm, lm_head
N_TENSORS = 1 + 2 * 9 + 1 + 1


def plan_args(cfg, **kw) -> argparse.Namespace:
    base = dict(
        config=str(cfg),
        world_size=2,
        recipe=["incremental", "quickstart"],
        disk_gbps=None,
        export_dtype="bf16",
        max_shard_size=None,
        trust_remote_code=False,
        json=True,
        overrides=[],
        max_actor_ckpt_to_keep=None,
        max_critic_ckpt_to_keep=None,
        critic=False,
    )
    return argparse.Namespace(**{**base, **kw})
