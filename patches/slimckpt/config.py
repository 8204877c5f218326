"""SlimCheckpointConfig: verl's CheckpointConfig plus the fields slimckpt's recipes set.

A recipe points `actor_rollout_ref.actor.checkpoint._target_` (and the critic's) here. verl
builds this dataclass in the driver and in every worker; building it is what switches slimckpt
on in that process (version guard, then the `checkpoint` patches). Without a recipe it is never
built and verl runs unpatched.
"""

from __future__ import annotations

from dataclasses import dataclass

from verl.trainer.config.config import CheckpointConfig

RECIPES = ("quickstart", "intermediate", "incremental")


@dataclass
class SlimCheckpointConfig(CheckpointConfig):
    """Fields (beyond verl's save_contents, load_contents, async_save, strict, save_lora_only):

    recipe: which tier set this config (quickstart | intermediate | incremental).
    measure: record peak anonymous RSS, bytes and seconds of every save (per rank, JSON next to
        the checkpoint and a log line).
    export_hf: after each actor save, export `huggingface/` safetensors from the freshly written
        shards with the streaming exporter (bounded memory) instead of verl's `hf_model` gather.
    export_dtype: dtype of the export (bf16 | fp16 | fp32), bf16 as verl's hf_model save.
    max_shard_size: largest safetensors file of the export, as Hugging Face's ("5GB").
    """

    recipe: str = "quickstart"
    measure: bool = True
    export_hf: bool = False
    export_dtype: str = "bf16"
    max_shard_size: str = "5GB"

    def __post_init__(self) -> None:
        parent = getattr(super(), "__post_init__", None)
        if parent is not None:
            parent()
        from .registry import REGISTRY, check_verl_version
        from .verl_patches import register_all

        check_verl_version()
        if self.recipe not in RECIPES:
            raise ValueError(f"checkpoint.recipe={self.recipe!r} is not a slimckpt recipe; use one of {RECIPES}")
        if "hf_model" in self.save_contents and self.export_hf:
            raise ValueError(
                "checkpoint.save_contents has 'hf_model' and export_hf=true: both would write huggingface/; "
                "drop 'hf_model' (export_hf replaces verl's gather)"
            )
        if self.export_dtype not in ("bf16", "fp16", "fp32"):
            raise ValueError(f"checkpoint.export_dtype={self.export_dtype!r}: use bf16, fp16 or fp32")
        register_all()
        REGISTRY.apply_feature("checkpoint")
