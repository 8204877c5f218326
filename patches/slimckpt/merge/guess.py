"""The merge's output names guessed without transformers or verl, so weights can be written while
they import.

A merge's first seconds go to importing verl and transformers (GIL-bound, no disk) only to learn
which names `save_pretrained` keeps: that is what `hf.naming.HfSide.output_names` asks a meta-device
model. For the models verl trains the answer is almost always "every checkpoint name, minus
FlowRL's log Z head, minus lm_head.weight when config.json ties the embeddings". `slimckpt merge`
starts writing with that guess and compares it with the real answer once the imports are done:
equal (the usual case) and the writes already made are kept; different, and the partial output is
discarded and written again with the real plan (a rewrite costs time, never correctness).

No torch, no transformers: pure name arithmetic on the checkpoint's names and config.json.
"""

from __future__ import annotations

import json
import os

from ..flowrl.names import is_flowrl_param
from ..format.names import is_lora_key

TIED_TARGET = "lm_head.weight"
TIED_SOURCE = "model.embed_tokens.weight"


def read_config(hf_dir: str) -> dict | None:
    try:
        with open(os.path.join(hf_dir, "config.json"), encoding="utf-8") as f:
            config = json.load(f)
    except (OSError, ValueError):
        return None  # the real planner reports it properly
    return config if isinstance(config, dict) else None


def guess_output_names(
    names: list[str], config: dict | None, shapes: dict[str, tuple[int, ...]] | None = None
) -> dict[str, str] | None:
    """{output name: checkpoint name} in checkpoint order, or None when there is no safe guess
    (no config, the tie setting not stated, LoRA, names transformers might rename, or, given
    `shapes`, a tensor it may split on save)."""
    if not config or not isinstance(config.get("tie_word_embeddings"), bool):
        return None
    if shapes is not None and any(is_fused(n, shapes[n]) for n in names):
        return None
    if any(is_lora_key(n) for n in names) or any(
        not n.startswith(("model.", "lm_head.")) for n in names if not is_flowrl_param(n)
    ):
        return None
    tied = config["tie_word_embeddings"] and TIED_SOURCE in names
    return {n: n for n in names if not is_flowrl_param(n) and not (tied and n == TIED_TARGET)}


def is_fused(name: str, shape: tuple[int, ...]) -> bool:
    """Whether transformers 5 may split this tensor into parts on save: a parameter of 3+ dims not
    named `.weight` (an MoE layer's fused experts, `mlp.experts.gate_up_proj` [E, 2I, H]). Which
    parts it makes is known only once transformers is imported, so the early write stands down
    for such a checkpoint; a convolution's `.weight` of 4-5 dims is written whole."""
    return len(shape) >= 3 and not name.endswith((".weight", ".bias"))
