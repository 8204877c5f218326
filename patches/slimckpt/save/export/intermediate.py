"""The intermediate tier's HF export: after verl has written a step's model shards, every rank
streams its share of them into `<step>/<role>/huggingface/` safetensors (slimckpt.merge.pipeline, using
the trainer's own process group), instead of verl's `hf_model` save, which gathers the whole
fp32 model into rank 0's host memory first.

Reading back shards that were just written costs I/O (mostly from the page cache) but no
memory beyond the merger's bounded chunks, and the result is exactly what `slimckpt merge` (and
so verl's merger) makes of that checkpoint: one code path for offline and in-training export.
"""

from __future__ import annotations

import os

from slimckpt.layout.names import HF_SUBDIR
from slimckpt.log import get_logger
from slimckpt.merge.pipeline import merge
from slimckpt.merge.plan import MergeError, MergeOptions
from slimckpt.save.os_fixes import trainer_fixes

# lazy imports: the merge pipeline and torch.distributed load only when a step is exported

log = get_logger("slimckpt.hf_export")


def export_hf_from_shards(
    local_path: str, dtype: str, max_shard_size: str, allow_verl_fallback: bool = True, merge_lora: bool = False
) -> None:
    """Collective over the default process group: every rank must call it after the save. MoE
    experts (split per expert on save) and LoRA actors (the base model + `lora_adapter/`, or with
    `merge_lora` the adapter merged into the base weights) are streamed like any checkpoint; what
    the streaming merge does not handle (a save-time conversion that is not a slice of one tensor)
    goes to verl's merger on rank 0, logged with the host memory it takes, or, with
    `allow_verl_fallback` off, is refused; either way every rank ends the same way."""

    target = os.path.join(local_path, HF_SUBDIR)
    opts = MergeOptions(
        local_dir=local_path,
        target_dir=target,
        dtype=dtype,
        max_shard_size=max_shard_size,
        distributed=True,
        # verl's save put config.json and the tokenizer in huggingface/; the export rewrites the
        # same files next to the weights and replaces the dir in one rename.
        overwrite=True,
        progress=False,
        overwrite_hint="(in-training export)",
        lock_source=False,  # the trainer holds the step's writer lock (slimckpt.save.errors)
        verl_fallback=allow_verl_fallback,
        verl_fallback_hint="checkpoint.allow_verl_fallback=false",
        merge_lora=merge_lora,
        merge_lora_hint="checkpoint.export_merge_lora=true",
        adapter_only=True,  # save_lora_only: lora_adapter/ alone (the base is model.path's)
        os_fixes=trainer_fixes(local_path),
    )
    try:
        result = merge(opts)
    except MergeError as exc:
        raise MergeError(f"HF export of {local_path} failed: {exc}") from None
    import torch.distributed as dist

    if dist.is_initialized() and dist.get_rank() != 0:
        return
    if result.used_verl_merger:
        log.warning("HF export of %s went through verl's own merger (see the line above for why)", local_path)
    else:
        log.info("HF export %s: %.3f GB of weights, %.1f s", target, result.weight_bytes / 1e9, result.seconds)
