"""Resume state of the incremental tier: model, optimizer and extra state (lr scheduler, RNG) of a
verl FSDPCheckpointManager, written with bounded host memory, reshardable, committed atomically.

Layout of a role directory (`<root>/global_step_N/actor`):

    dcp/                       torch.distributed.checkpoint (DCP): `__{rank}_0.distcp` per rank and
                               `.metadata` (global shapes and where each chunk lives). Model and
                               optimizer are keyed by parameter name, not by rank, so a load at any
                               world size reads the rows it needs (resharding).
    slimckpt_extra_world_size_{W}_rank_{r}.pt   lr scheduler + RNG of rank r, as verl's extra_state
    huggingface/, fsdp_config.json              written by verl's own save code, unchanged
    slimckpt_resume.json       the manifest, written LAST (see resume_manifest): no manifest, no load

Flow (plan -> stage -> write -> commit), one module per job:

    resume_save    plan and stage: verl's own save for the rest, extra state, the sharded state
                   dict (state_dicts), the HF export's plan; then sync, pool or stream by async_save
                   (async_modes: the mode's stage, then its finish)
    step_write     DCP shards, then the gather-free HF export (hf_direct_export), in the foreground
                   or on the background writer's thread (resume_async), all of one save's inputs
                   in a SaveContext (save_context)
    step_commit    every rank reports its files, rank 0 writes the manifest and only then applies
                   retention, every rank learns the outcome (collective.outcome)
    step_check     a committed step checked by every rank before a load reads it
    resume_load    the load at any world size, and the load patch that picks this tier or verl's
    extra_state    lr scheduler + RNG files; manager_state: what is kept per manager

No rank's save (or background write) ends before its step is committed or has failed.

Everything else verl's save does (huggingface/ config + tokenizer + generation config on rank 0,
fsdp_config.json, LoRA meta, `hf_model` if asked) is done by calling verl's own save with the shard
contents removed, so it stays exactly verl's. With `export_hf`, the weights of huggingface/ are
written without a gather (hf_direct_export, in place of verl's `hf_model`): planned at save time,
written after the shards (from the staged copy in async mode) and before the commit.

verl's `save_lora_only` (a peft actor): as verl's own save keeps only the keys holding "lora_" or
".adapter_", the step's model state is the adapter's parameters (the optimizer state is theirs
anyway: the base is frozen), the manifest says `lora_only`, the export is `lora_adapter/` alone,
and a load sets those parameters and keeps the base weights the model was built with, i.e.
actor_rollout_ref.model.path's (what the user needs at load: the same base model).
"""

from __future__ import annotations

import os

import slimckpt.save.modes.writer as resume_async
from slimckpt.engine.checkpoint_dir import DCP_DIR
from slimckpt.layout.resume_manifest import has_manifest


def is_resume_state(local_path: str | None) -> bool:
    """True when `local_path` was written by this tier (committed or not)."""
    if not local_path:
        return False
    return has_manifest(local_path) or os.path.isdir(os.path.join(local_path, DCP_DIR))


def finish_pending() -> None:
    """Wait for every background write of this process (scripts call it before destroying the
    process group; atexit calls it too)."""
    resume_async.finish_all()


__all__ = ["finish_pending", "is_resume_state"]
