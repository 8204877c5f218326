"""The load of the incremental tier, and the load patch that picks this tier's format or verl's.

A load first waits for every write of the dir in this process (a sync save would have returned
only after its commit), checks the step on every rank (step_check), refuses a booby-trapped
pickle on every rank (pickle_gate), then reads the shards with DCP at any world size
(resharding), the extra state of the matching saved rank, and meets the other ranks. A step
whose optimizer state retention dropped loads the rest, saying so in one line.
"""

from __future__ import annotations

# lazy imports: torch.distributed.checkpoint loads when a step is loaded, not when the patch that
# imports this module is applied in every worker
import functools
import os
import warnings

import torch.distributed as dist

from ..format.dropped_optimizer import optimizer_dropped, resume_line
from ..format.names import is_lora_key
from ..format.resume_manifest import Manifest
from ..log import get_logger
from ..read import in_flight
from ..read.checkpoint_dir import DCP_DIR
from ..read.locks import reading_if_dir
from ..read.pickle_policy import trusting
from ..read.step_pickles import dcp_refusals, native_refusals
from ..verl_seam.manager_state import config_of
from . import resume_async, step_check
from .contents import load_contents
from .extra_state import extra_path, load_extra
from .pickle_gate import refuse_together
from .process_group import checkpoint_group, made_group
from .resume_state import is_resume_state

log = get_logger("slimckpt.resume")


def _without_optimizer(manager) -> list[str]:
    return [c for c in manager.checkpoint_load_contents if c != "optimizer"]


def load_resume_state(manager, local_path: str) -> None:
    """Load model, optimizer and extra state written by save_resume_state, at any world size; a
    step whose optimizer state retention dropped loads the rest, saying so in one line."""
    group = checkpoint_group(manager)
    # every rank raises the same one-line error; checksums unless the config says verify: false
    manifest = step_check.check_committed(local_path, group, config_of(manager).verify)
    extra = extra_path(local_path, manifest.world_size, manager.rank % manifest.world_size)
    refuse_together(group, lambda: dcp_refusals(local_path, [extra]))

    if manager.should_load_optimizer and "optimizer" not in manifest.contents and optimizer_dropped(local_path):
        # retention's keep_optimizer_last dropped it: the step is whole otherwise (see docs/retention.md)
        if manager.rank == 0:
            log.warning("%s", resume_line(local_path, _without_optimizer(manager)))
        with load_contents(manager, _without_optimizer(manager)):
            return _load_committed(manager, local_path, manifest, group)
    return _load_committed(manager, local_path, manifest, group)


def _load_committed(manager, local_path: str, manifest: Manifest, group: dist.ProcessGroup) -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import set_model_state_dict

    from ..read.dcp_pickle import CheckedFileSystemReader, CheckedLoadPlanner
    from . import optim_capture
    from .state_dicts import LORA_ONLY_KEY, build_state_dict, load_options, options

    missing = [
        c
        for c in ("model", "optimizer", "extra")
        if c in manager.checkpoint_load_contents and c not in manifest.contents
    ]
    if missing:
        raise ValueError(
            f"slimckpt: checkpoint.load_contents asks for {missing} but {local_path} was saved with "
            f"{manifest.contents}; drop them from load_contents"
        )
    with_optim_state = manager.should_load_optimizer and optim_capture.saved_with_state(
        os.path.join(local_path, DCP_DIR)
    )
    state = build_state_dict(
        manager,
        model=manager.should_load_model,
        optimizer=manager.should_load_optimizer,
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
            for alias, target in aliases.items():
                state["model"][alias] = state["model"][target]
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            if "model" in state:
                set_model_state_dict(manager.model, state["model"], options=load_options(lora_only))
        if "optim" in state:
            optim_capture.apply(manager.model, manager.optimizer, state["optim"], options())
    if manager.should_load_extra:
        load_extra(manager, local_path, manifest.world_size)
    if manager.rank == 0:
        how = (
            ""
            if manifest.world_size == manager.world_size
            else f" (saved at world size {manifest.world_size}, resharded to {manager.world_size})"
        )
        if lora_only:
            how += "; LoRA weights only (save_lora_only): the base weights are the model's own (model.path)"
        log.info("loaded step %s from %s%s", manifest.global_step, local_path, how)
    dist.barrier(group=group)


# --------------------------------------------------------------------------- the load patch


def _after_saves_here(manager, local_path: str | None) -> None:
    """What a load waits for first: this manager's background write (a load overwrites the shards
    it may still read, whichever format is loaded) and any other write of `local_path` in this
    process, each until its commit has ended on every rank, as a sync save would have returned;
    then every rank of a manager that saved meets the others, since the rank 0 of a save holds the
    dir's writer lock until its save call returns, after the other ranks' have."""
    resume_async.writer_for(manager).wait()
    in_flight.wait_for(local_path)
    group = made_group(manager)  # made on every rank, by their first save or load
    if group is not None:
        dist.barrier(group=group)


def wrap_load_checkpoint(original):
    """FSDPCheckpointManager.load_checkpoint: this tier's format when the directory has it, verl's
    own otherwise, so resume_mode=auto works across both."""

    @functools.wraps(original)
    def load_checkpoint(self, local_path, hdfs_path=None, del_local_after_load=False):
        _after_saves_here(self, local_path)
        with reading_if_dir(local_path, f"loading it (rank {self.rank})"):  # retention keeps it meanwhile
            with trusting(config_of(self).trust_pickle):
                if local_path is not None and is_resume_state(local_path):
                    return load_resume_state(self, local_path)
                if local_path is not None:  # verl's own load unpickles them unchecked
                    refuse_together(
                        checkpoint_group(self), lambda: native_refusals(local_path, self.world_size, self.rank)
                    )
                if local_path is not None and optimizer_dropped(local_path) and self.should_load_optimizer:
                    loads = _without_optimizer(self)
                    if self.rank == 0:
                        log.warning("%s", resume_line(local_path, loads))
                    with load_contents(self, loads):
                        return original(self, local_path, hdfs_path, del_local_after_load)
                return original(self, local_path, hdfs_path, del_local_after_load)

    return load_checkpoint


__all__ = ["load_resume_state", "wrap_load_checkpoint"]
