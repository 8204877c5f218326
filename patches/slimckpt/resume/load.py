"""The load of the incremental tier (the verl wing's load patch picks this tier's format or verl's).

A load first waits for every write of the dir in this process (a sync save would have returned
only after its commit), checks the step on every rank (step_check), refuses a booby-trapped
pickle on every rank (pickle_gate), then reads the shards with DCP at any world size
(resharding), the extra state of the matching saved rank, and meets the other ranks. A step
whose optimizer state retention dropped loads the rest, saying so in one line.
"""

from __future__ import annotations

import os
import warnings

import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import set_model_state_dict

import slimckpt.save.modes.writer as resume_async
from slimckpt.engine.checkpoint_dir import DCP_DIR
from slimckpt.engine.dcp_pickle import CheckedFileSystemReader, CheckedLoadPlanner
from slimckpt.engine.step_pickles import dcp_refusals
from slimckpt.layout.dropped_optimizer import optimizer_dropped, resume_line
from slimckpt.layout.names import SHARD_CONTENTS, is_lora_key
from slimckpt.layout.resume_manifest import Manifest
from slimckpt.log import get_logger
from slimckpt.resume import step_check
from slimckpt.resume.pickle_gate import refuse_together
from slimckpt.save import optim_capture
from slimckpt.save.extra_state import extra_path, load_extra
from slimckpt.save.process_group import checkpoint_group, made_group
from slimckpt.save.state_dicts import LORA_ONLY_KEY, build_state_dict, load_options, options
from slimckpt.save.target import SaveTarget, TargetState
from slimckpt.storage import check_access_once, in_flight

log = get_logger("slimckpt.resume")


def without_optimizer(contents) -> list[str]:
    """The load contents of a step whose optimizer state retention dropped."""
    return [c for c in contents if c != "optimizer"]


def load_resume_state(target: SaveTarget, local_path: str) -> None:
    """Load model, optimizer and extra state written by save_resume_state, at any world size; a
    step whose optimizer state retention dropped loads the rest, saying so in one line."""
    check_access_once(local_path)  # this rank's environment reaches it (a URL)
    group = checkpoint_group(target.state)
    # every rank raises the same one-line error; checksums unless the options say verify: false
    manifest = step_check.check_committed(local_path, group, target.options.verify)
    extra = extra_path(local_path, manifest.world_size, target.rank % manifest.world_size)
    refuse_together(group, lambda: dcp_refusals(local_path, [extra]))

    if target.should_load_optimizer and "optimizer" not in manifest.contents and optimizer_dropped(local_path):
        # retention's keep_optimizer_last dropped it: the step is whole otherwise (see docs/retention.md)
        loads = without_optimizer(target.load_contents)
        if target.rank == 0:
            log.warning("%s", resume_line(local_path, loads))
        return _load_committed(target.loading(loads), local_path, manifest, group)
    return _load_committed(target, local_path, manifest, group)


def _load_committed(target: SaveTarget, local_path: str, manifest: Manifest, group: dist.ProcessGroup) -> None:
    missing = [c for c in SHARD_CONTENTS if c in target.load_contents and c not in manifest.contents]
    if missing:
        raise ValueError(
            f"slimckpt: checkpoint.load_contents asks for {missing} but {local_path} was saved with "
            f"{manifest.contents}; drop them from load_contents"
        )
    with_optim_state = target.should_load_optimizer and optim_capture.saved_with_state(
        os.path.join(local_path, DCP_DIR)
    )
    state = build_state_dict(
        target,
        model=target.should_load_model,
        optimizer=target.should_load_optimizer,
        optimizer_state=with_optim_state,
    )
    aliases = dict(manifest.extra.get("aliases") or {})
    lora_only = bool(manifest.extra.get(LORA_ONLY_KEY)) and "model" in state
    if state:
        if "model" in state:
            state["model"] = {k: v for k, v in state["model"].items() if k not in aliases}
        if lora_only:  # the base weights stay those the model was built with (model.path)
            state["model"] = {k: v for k, v in state["model"].items() if is_lora_key(k)}
            if not state["model"]:
                raise ValueError(
                    f"slimckpt: {local_path} holds LoRA weights only (save_lora_only) and this model has "
                    f"no LoRA adapter; resume with the saving run's LoRA settings "
                    f"(actor_rollout_ref.model.lora_rank, target_modules)"
                )
        dcp_dir = os.path.join(local_path, DCP_DIR)
        dcp.load(
            state,
            storage_reader=CheckedFileSystemReader(dcp_dir),
            planner=CheckedLoadPlanner(dcp_dir),
            process_group=group,
        )
        if "model" in state:
            for alias, written in aliases.items():
                state["model"][alias] = state["model"][written]
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            if "model" in state:
                set_model_state_dict(target.model, state["model"], options=load_options(lora_only))
        if "optim" in state:
            optim_capture.apply(target.model, target.optimizer, state["optim"], options())
    if target.should_load_extra:
        load_extra(target, local_path, manifest.world_size)
    if target.rank == 0:
        how = (
            ""
            if manifest.world_size == target.world_size
            else f" (saved at world size {manifest.world_size}, resharded to {target.world_size})"
        )
        if lora_only:
            how += "; LoRA weights only (save_lora_only): the base weights are the model's own (model.path)"
        log.info("loaded step %s from %s%s", manifest.global_step, local_path, how)
    dist.barrier(group=group)


def after_saves_here(state: TargetState, local_path: str | None) -> None:
    """What a load waits for first: this target's background write (a load overwrites the shards
    it may still read, whichever format is loaded) and any other write of `local_path` in this
    process, each until its commit has ended on every rank, as a sync save would have returned;
    then every rank of a target that saved meets the others, since the rank 0 of a save holds the
    dir's writer lock until its save call returns, after the other ranks' have."""
    resume_async.writer_for(state).wait()
    in_flight.wait_for(local_path)
    group = made_group(state)  # made on every rank, by their first save or load
    if group is not None:
        dist.barrier(group=group)


__all__ = ["after_saves_here", "load_resume_state", "without_optimizer"]
