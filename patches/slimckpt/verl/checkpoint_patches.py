"""The bodies of slimckpt's patches on verl's FSDPCheckpointManager (features "checkpoint" and "measure").

Each turns the manager into a SaveTarget (save_target) and hands it to the engine (slimckpt.save):
- save_checkpoint: a recipe's SlimCheckpointConfig routes the save through the tier it asks for,
  measured unless its `measure` is off (slimckpt.observe.save_measure), under the writer lock and
  on_save_error (slimckpt.save.errors); any other config runs verl's original save untouched;
- load_checkpoint: the incremental tier's format when the directory has it, verl's own otherwise;
- ensure_checkpoint_capacity / register_checkpoint: retention (slimckpt.save.retention.prune);
- the "measure" feature: verl's own save, measured and otherwise untouched.
"""

# lazy imports: a tier's modules (DCP, the export) load at its first save, not when a patch that
# names this module is applied in every worker
from __future__ import annotations

import functools

import slimckpt.save.retention.prune as retention
from slimckpt.engine.pickle_policy import trusting
from slimckpt.engine.step_pickles import native_refusals
from slimckpt.layout.dropped_optimizer import optimizer_dropped, resume_line
from slimckpt.log import get_logger
from slimckpt.observe.save_measure import measured_save
from slimckpt.resume.load import after_saves_here, load_resume_state, without_optimizer
from slimckpt.resume.pickle_gate import refuse_together
from slimckpt.save.errors import guarded_save
from slimckpt.save.export.intermediate import export_hf_from_shards
from slimckpt.save.process_group import checkpoint_group
from slimckpt.save.resume_state import is_resume_state
from slimckpt.save.step_save import save_resume_state
from slimckpt.storage.locks import reading_if_dir
from slimckpt.verl.checkpoint_config import SlimCheckpointConfig
from slimckpt.verl.manager_state import config_of, state_of
from slimckpt.verl.save_target import load_contents, target_of

log = get_logger("slimckpt.save")


# --------------------------------------------------------------------------- save


def wrap_save_checkpoint(original):
    @functools.wraps(original)
    def save_checkpoint(self, local_path, hdfs_path=None, global_step=0, max_ckpt_to_keep=None):
        def save():
            return _guarded_dispatch(original, self, local_path, hdfs_path, global_step, max_ckpt_to_keep)

        if local_path is None:
            return original(self, local_path, hdfs_path, global_step, max_ckpt_to_keep)
        config = self.checkpoint_config
        if isinstance(config, SlimCheckpointConfig) and config.measure:
            return measured_save(state_of(self), config, self.rank, self.world_size, local_path, global_step, save)
        return save()

    return save_checkpoint


def _guarded_dispatch(original, manager, local_path, hdfs_path, global_step, max_ckpt_to_keep):
    """A recipe's save runs its tier under slimckpt.save.errors (writer lock, one-line errors,
    on_save_error); any other config runs verl's save as it is."""
    if not isinstance(manager.checkpoint_config, SlimCheckpointConfig):
        return original(manager, local_path, hdfs_path, global_step, max_ckpt_to_keep)

    target = target_of(manager, original, hdfs_path, global_step)
    return guarded_save(
        target,
        local_path,
        int(global_step),
        lambda: _tier_save(original, manager, target, local_path, hdfs_path, global_step, max_ckpt_to_keep),
    )


def _tier_save(original, manager, target, local_path, hdfs_path, global_step, max_ckpt_to_keep):
    config = target.options
    if config.incremental_save:
        manager.previous_global_step = global_step
        return save_resume_state(target, local_path, global_step, max_ckpt_to_keep)
    result = original(manager, local_path, hdfs_path, global_step, max_ckpt_to_keep)
    if config.export_hf:
        export_hf_from_shards(
            local_path, config.export_dtype, config.max_shard_size, config.allow_verl_fallback, config.export_merge_lora
        )
    return result


def wrap_save_measured(original):
    """Feature "measure": verl's save_checkpoint, measured and otherwise untouched."""

    @functools.wraps(original)
    def save_checkpoint(self, local_path, hdfs_path=None, global_step=0, max_ckpt_to_keep=None):
        return measured_save(
            state_of(self),
            self.checkpoint_config,
            self.rank,
            self.world_size,
            local_path,
            global_step,
            lambda: original(self, local_path, hdfs_path, global_step, max_ckpt_to_keep),
        )

    return save_checkpoint


# --------------------------------------------------------------------------- load


def wrap_load_checkpoint(original):
    """FSDPCheckpointManager.load_checkpoint: this tier's format when the directory has it, verl's
    own otherwise, so resume_mode=auto works across both."""

    @functools.wraps(original)
    def load_checkpoint(self, local_path, hdfs_path=None, del_local_after_load=False):
        after_saves_here(state_of(self), local_path)
        with reading_if_dir(local_path, f"loading it (rank {self.rank})"):  # retention keeps it meanwhile
            with trusting(config_of(self).trust_pickle):
                if local_path is not None and is_resume_state(local_path):
                    return load_resume_state(target_of(self), local_path)
                if local_path is not None:  # verl's own load unpickles them unchecked
                    refuse_together(
                        checkpoint_group(state_of(self)),
                        lambda: native_refusals(local_path, self.world_size, self.rank),
                    )
                if local_path is not None and optimizer_dropped(local_path) and self.should_load_optimizer:
                    loads = without_optimizer(self.checkpoint_load_contents)
                    if self.rank == 0:
                        log.warning("%s", resume_line(local_path, loads))
                    with load_contents(self, loads):
                        return original(self, local_path, hdfs_path, del_local_after_load)
                return original(self, local_path, hdfs_path, del_local_after_load)

    return load_checkpoint


# --------------------------------------------------------------------------- retention


def before_save(manager, max_keep) -> None:
    """verl's ensure_checkpoint_capacity: nothing deleted before the new step is complete."""
    retention.before_save(state_of(manager), config_of(manager), manager.previous_saved_paths, max_keep)


def after_save(manager, new_path: str, max_keep) -> list[str]:
    """verl's register_checkpoint: track `new_path` in the manager's list and delete what retention allows."""
    return retention.after_save(state_of(manager), config_of(manager), manager.previous_saved_paths, new_path, max_keep)


def wrap_ensure_checkpoint_capacity(original):
    @functools.wraps(original)
    def ensure_checkpoint_capacity(self, max_ckpt_to_keep):
        before_save(self, max_ckpt_to_keep)

    return ensure_checkpoint_capacity


def wrap_register_checkpoint(original):
    @functools.wraps(original)
    def register_checkpoint(self, new_path, max_ckpt_to_keep):
        after_save(self, new_path, max_ckpt_to_keep)

    return register_checkpoint


__all__ = [
    "after_save",
    "before_save",
    "wrap_ensure_checkpoint_capacity",
    "wrap_load_checkpoint",
    "wrap_register_checkpoint",
    "wrap_save_checkpoint",
    "wrap_save_measured",
]
