"""The save of the incremental tier: plan, then stage (or not), then hand the write to its thread.

Drop-in for FSDPCheckpointManager.save_checkpoint with an incremental SlimCheckpointConfig. In the
foreground: wait for the previous save's commit, clear the step's dir, run verl's own save for
everything but the shards, write the extra state, build the sharded state dict, plan the HF
export. Then by async_save: off streams the shards now (step_write); pool stages the rank's
tensors into the host pool (within host_memory_budget_gb) and writes them on the background
thread; stream writes on that thread from the live shards, guarded until read (stream_capture).
Either way no rank's save (or background write) ends before its step is committed or has failed.
"""

from __future__ import annotations

import time

import torch.distributed as dist
from verl.utils.fs import local_mkdir_safe

from ..verl_seam.manager_state import config_of
from . import hf_direct_export, resume_async, retention
from .async_modes.registry import mode_for
from .contents import save_contents
from .extra_state import save_extra
from .process_group import checkpoint_group
from .save_context import SaveContext
from .state_dicts import build_state_dict, lora_only_state, note_fsdp1_copy, note_lora_only, split_aliases
from .step_commit import clear_stale, drop_first, make_room

SHARD_CONTENTS = ("model", "optimizer", "extra")


def _lap(timings: dict[str, float]):
    """timings[name] = seconds since the previous lap (the save's phases, kept in the manifest)."""
    last = [time.perf_counter()]

    def lap(name: str) -> None:
        now = time.perf_counter()
        timings[name] = now - last[0]
        last[0] = now

    return lap


def save_resume_state(
    original,
    manager,
    local_path: str,
    hdfs_path: str | None = None,
    global_step: int = 0,
    max_ckpt_to_keep: int | None = None,
) -> None:
    """Drop-in for FSDPCheckpointManager.save_checkpoint with an incremental SlimCheckpointConfig.

    `original` is verl's unpatched save; it still writes everything but the shards."""
    config = config_of(manager)
    lora_only = bool(manager.should_save_lora_only and manager._has_lora())
    writer = resume_async.writer_for(manager)
    waited = time.perf_counter()
    writer.wait()  # a save starts only once the previous one is committed
    start = time.perf_counter()
    timings = {"wait_previous": start - waited}
    lap = _lap(timings)
    group = checkpoint_group(manager)
    manager.previous_global_step = global_step
    local_path = local_mkdir_safe(local_path)
    drops: list[str] = []
    if manager.rank == 0:
        drops = make_room(manager, max_ckpt_to_keep)
        clear_stale(local_path)
    dist.barrier(group=group)
    lap("setup")

    contents = [c for c in manager.checkpoint_save_contents if c in SHARD_CONTENTS]
    # verl's own save for huggingface/, fsdp_config.json, LoRA meta and hf_model; retention later
    with save_contents(manager, hf_direct_export.verl_contents(manager, config)), retention.deferred(manager):
        original(manager, local_path, hdfs_path, global_step, None)
    lap("verl_save")

    if manager.should_save_extra:
        save_extra(manager, local_path)
    lap("extra")
    state = build_state_dict(manager, model=manager.should_save_model, optimizer=manager.should_save_optimizer)
    note_fsdp1_copy(manager, state)
    aliases: dict[str, str] = {}
    if "model" in state:
        if lora_only:  # verl's save_lora_only: the adapter's parameters (the optimizer holds only theirs)
            total = len(state["model"])
            state["model"] = lora_only_state(state["model"])
            note_lora_only(manager, state["model"], total)
        state["model"], aliases = split_aliases(state["model"])
    lap("state_dict")
    # planned here, in the foreground, from the shards' specs (a staged copy has the same ones)
    export = (
        hf_direct_export.plan_export(manager, local_path, state.get("model", {}), aliases, config, group)
        if config.export_hf
        else None
    )
    lap("plan_export")

    ctx = SaveContext(
        manager=manager,
        local_path=local_path,
        step=global_step,
        group=group,
        config=config,
        contents=contents,
        max_keep=max_ckpt_to_keep,
        timings=timings,
        aliases=aliases,
        lora_only=lora_only,
        export=export,
        first=drop_first(manager, drops),
    )
    mode = mode_for(config)
    staged = mode.stage(ctx, state, writer)
    if staged.phase is not None:  # taken in the foreground: the rest runs on the writer's thread
        lap(staged.phase)
        timings["blocking"] = time.perf_counter() - waited
    del state
    mode.finish(staged, writer)


__all__ = ["SHARD_CONTENTS", "save_resume_state"]
