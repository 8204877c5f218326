"""What slimckpt does around verl's FSDPCheckpointManager.save_checkpoint (feature "checkpoint").

A recipe's SlimCheckpointConfig routes the save through the tier it asks for, measured unless
its `measure` is off (slimckpt.observe.save_measure); any other config runs verl's original save
untouched (measuring plain verl is the separate "measure" feature, SLIMCKPT_MEASURE=1).
"""

from __future__ import annotations

# lazy imports: a tier's modules (DCP, the export) load at its first save, not when the patch
# that imports this module is applied in every worker
import functools

from ..log import get_logger
from ..observe.save_measure import measured_save
from ..verl_seam.checkpoint_config import SlimCheckpointConfig

log = get_logger("slimckpt.save")


def wrap_save_checkpoint(original):
    @functools.wraps(original)
    def save_checkpoint(self, local_path, hdfs_path=None, global_step=0, max_ckpt_to_keep=None):
        def save():
            return _guarded_dispatch(original, self, local_path, hdfs_path, global_step, max_ckpt_to_keep)

        if local_path is None:
            return original(self, local_path, hdfs_path, global_step, max_ckpt_to_keep)
        config = self.checkpoint_config
        if isinstance(config, SlimCheckpointConfig) and config.measure:
            return measured_save(self, local_path, global_step, save)
        return save()

    return save_checkpoint


def _guarded_dispatch(original, manager, local_path, hdfs_path, global_step, max_ckpt_to_keep):
    """A recipe's save runs under slimckpt.save.errors (writer lock, one-line errors, on_save_error)."""
    if not isinstance(manager.checkpoint_config, SlimCheckpointConfig):
        return _dispatch(original, manager, local_path, hdfs_path, global_step, max_ckpt_to_keep)
    from .errors import guarded_save

    return guarded_save(
        manager,
        local_path,
        int(global_step),
        lambda: _dispatch(original, manager, local_path, hdfs_path, global_step, max_ckpt_to_keep),
    )


def _dispatch(original, manager, local_path, hdfs_path, global_step, max_ckpt_to_keep):
    config = manager.checkpoint_config
    if not isinstance(config, SlimCheckpointConfig):
        return original(manager, local_path, hdfs_path, global_step, max_ckpt_to_keep)
    if config.incremental_save:
        from .resume_save import save_resume_state

        return save_resume_state(original, manager, local_path, hdfs_path, global_step, max_ckpt_to_keep)
    result = original(manager, local_path, hdfs_path, global_step, max_ckpt_to_keep)
    if config.export_hf:
        from .hf_export import export_hf_from_shards

        export_hf_from_shards(
            local_path, config.export_dtype, config.max_shard_size, config.allow_verl_fallback, config.export_merge_lora
        )
    return result
