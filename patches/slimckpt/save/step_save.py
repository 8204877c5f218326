"""The save of the incremental tier: plan, then stage (or not), then hand the write to its thread.

For a SaveTarget whose options say incremental_save. In the foreground: wait for the previous save's
commit, clear the step's dir, have the caller write its own files (the target's side_files: verl's
huggingface/ and fsdp_config.json), write the extra state, build the sharded state dict, plan the
HF export. Then by async_save: off streams the shards now (step_write); pool stages the rank's
tensors into the host pool (within host_memory_budget_gb) and writes them on the background
thread; stream writes on that thread from the live shards, guarded until read (stream_capture).
Either way no rank's save (or background write) ends before its step is committed or has failed.
"""

from __future__ import annotations

import time

import torch.distributed as dist

import slimckpt.save.export.direct as hf_direct_export
import slimckpt.save.modes.writer as resume_async
import slimckpt.save.retention.prune as retention
from slimckpt.layout.names import SHARD_CONTENTS
from slimckpt.save.extra_state import save_extra
from slimckpt.save.modes.registry import mode_for
from slimckpt.save.process_group import checkpoint_group
from slimckpt.save.save_context import SaveContext
from slimckpt.save.state_dicts import build_state_dict, lora_only_state, note_fsdp1_copy, note_lora_only, split_aliases
from slimckpt.save.step_commit import clear_stale, drop_first, make_room
from slimckpt.save.target import SaveTarget
from slimckpt.storage import absolute, check_access_once, for_path, scheme_of


def _lap(timings: dict[str, float]):
    """timings[name] = seconds since the previous lap (the save's phases, kept in the manifest)."""
    last = [time.perf_counter()]

    def lap(name: str) -> None:
        now = time.perf_counter()
        timings[name] = now - last[0]
        last[0] = now

    return lap


def save_resume_state(
    target: SaveTarget,
    local_path: str,
    global_step: int = 0,
    max_ckpt_to_keep: int | None = None,
) -> None:
    """Save `target`'s shards (and its caller's own files, through target.side_files) as step
    `global_step` in `local_path`, committed by a manifest; returns once the step is committed, or
    once the background writer has it (async_save)."""
    config = target.options
    lora_only = target.lora_only
    writer = resume_async.writer_for(target.state)
    waited = time.perf_counter()
    writer.wait()  # a save starts only once the previous one is committed
    start = time.perf_counter()
    timings = {"wait_previous": start - waited}
    lap = _lap(timings)
    group = checkpoint_group(target.state)
    local_path = absolute(local_path)
    check_access_once(local_path)  # this rank's environment reaches it (a URL), before anything is written
    store = for_path(local_path)
    if config.export_hf and not store.supports_inplace_writes:
        # every rank writes its rows of the export's files at their offsets: one file, many writers
        raise ValueError(
            f"slimckpt: {local_path}: the in-training HF export cannot be written to "
            f"{scheme_of(local_path)}:// (no in-place writes there); set "
            f"actor_rollout_ref.actor.checkpoint.export_hf=false and run `slimckpt merge` from the step afterwards"
        )
    store.make_dirs(local_path, exist_ok=True)
    drops: list[str] = []
    if target.rank == 0:
        drops = make_room(target, max_ckpt_to_keep)
        clear_stale(local_path)
    dist.barrier(group=group)
    lap("setup")

    contents = [c for c in target.save_contents if c in SHARD_CONTENTS]
    # the caller's own files (verl: huggingface/, fsdp_config.json, LoRA meta and hf_model); retention later
    if target.side_files is not None:
        with retention.deferred(target.state):
            target.side_files(local_path, hf_direct_export.side_contents(target))
    lap("verl_save")

    if target.should_save_extra:
        save_extra(target, local_path)
    lap("extra")
    state = build_state_dict(target, model=target.should_save_model, optimizer=target.should_save_optimizer)
    note_fsdp1_copy(target, state)
    aliases: dict[str, str] = {}
    if "model" in state:
        if lora_only:  # verl's save_lora_only: the adapter's parameters (the optimizer holds only theirs)
            total = len(state["model"])
            state["model"] = lora_only_state(state["model"])
            note_lora_only(target, state["model"], total)
        state["model"], aliases = split_aliases(state["model"])
    lap("state_dict")
    # planned here, in the foreground, from the shards' specs (a staged copy has the same ones)
    export = (
        hf_direct_export.plan_export(target, local_path, state.get("model", {}), aliases, config, group)
        if config.export_hf
        else None
    )
    lap("plan_export")

    ctx = SaveContext(
        target=target,
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
        first=drop_first(target, drops),
    )
    mode = mode_for(config)
    staged = mode.stage(ctx, state, writer)
    if staged.phase is not None:  # taken in the foreground: the rest runs on the writer's thread
        lap(staged.phase)
        timings["blocking"] = time.perf_counter() - waited
    del state
    mode.finish(staged, writer)


__all__ = ["save_resume_state"]
