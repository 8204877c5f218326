"""What slimckpt does around verl's FSDPCheckpointManager.save_checkpoint.

Every save is measured when the patch is on (peak anonymous RSS above the process's level before
the save, bytes this rank wrote, seconds). A recipe's SlimCheckpointConfig routes the save
through the tier it asks for; any other config runs verl's original save untouched.
"""

from __future__ import annotations

import functools
import json
import os
import time
from typing import Any

from ..log import get_logger
from ..observe.memory import RssSampler
from ..read.checkpoint_dir import rank_files

log = get_logger("slimckpt.save")

METRICS_FILE_ENV = "SLIMCKPT_METRICS_FILE"


def _bytes_of(paths: list[str]) -> int:
    total = 0
    for path in paths:
        try:
            total += os.path.getsize(path)
        except OSError:
            pass
    return total


def record_save_metrics(metrics: dict[str, Any], local_path: str, rank: int) -> None:
    """One JSON per rank next to the checkpoint, a line in $SLIMCKPT_METRICS_FILE, a log line."""
    os.makedirs(local_path, exist_ok=True)
    with open(os.path.join(local_path, f"slimckpt_save_rank_{rank}.json"), "w") as f:
        json.dump(metrics, f, indent=1)
    target = os.environ.get(METRICS_FILE_ENV)
    if target:
        os.makedirs(os.path.dirname(os.path.abspath(target)), exist_ok=True)
        with open(target, "a") as f:
            f.write(json.dumps(metrics) + "\n")
    log.info(
        "save step %s rank %s: %.2f s, +%.1f MiB peak anonymous RSS, %.1f MiB written",
        metrics["global_step"], rank, metrics["seconds"], metrics["peak_rss_extra_bytes"] / 2**20,
        metrics["bytes_written"] / 2**20,
    )


def wrap_save_checkpoint(original):
    @functools.wraps(original)
    def save_checkpoint(self, local_path, hdfs_path=None, global_step=0, max_ckpt_to_keep=None):
        if local_path is None:
            return original(self, local_path, hdfs_path, global_step, max_ckpt_to_keep)
        config = self.checkpoint_config
        measure = bool(getattr(config, "measure", True))
        recipe = getattr(config, "recipe", None)
        start = time.perf_counter()
        with RssSampler() as sampler:
            result = _guarded_dispatch(original, self, local_path, hdfs_path, global_step, max_ckpt_to_keep)
        seconds = time.perf_counter() - start
        if measure and not getattr(self, "_slimckpt_save_failed", None):
            files = [os.path.join(local_path, f) for f in rank_files(local_path, self.rank)]
            if self.rank == 0:
                hf_dir = os.path.join(local_path, "huggingface")
                files += [os.path.join(hf_dir, n) for n in os.listdir(hf_dir)] if os.path.isdir(hf_dir) else []
            record_save_metrics(
                {
                    "global_step": int(global_step),
                    "rank": int(self.rank),
                    "world_size": int(self.world_size),
                    "role": os.path.basename(os.path.normpath(local_path)),
                    "recipe": recipe or "verl-default",
                    "save_contents": list(getattr(config, "save_contents", []) or []),
                    "seconds": seconds,
                    "blocking_seconds": seconds,
                    "rss_anon_before_bytes": sampler.result.baseline,
                    "peak_rss_anon_bytes": sampler.result.peak,
                    "peak_rss_extra_bytes": sampler.result.extra,
                    "bytes_written": _bytes_of(files),
                    "time": time.time(),
                },
                local_path,
                self.rank,
            )
        return result

    return save_checkpoint


def _guarded_dispatch(original, manager, local_path, hdfs_path, global_step, max_ckpt_to_keep):
    """A recipe's save runs under slimckpt.save.errors (writer lock, one-line errors, on_save_error)."""
    from ..verl.checkpoint_config import SlimCheckpointConfig

    if not isinstance(manager.checkpoint_config, SlimCheckpointConfig):
        return _dispatch(original, manager, local_path, hdfs_path, global_step, max_ckpt_to_keep)
    from .errors import guarded_save

    return guarded_save(manager, local_path, int(global_step), lambda: _dispatch(
        original, manager, local_path, hdfs_path, global_step, max_ckpt_to_keep))


def _dispatch(original, manager, local_path, hdfs_path, global_step, max_ckpt_to_keep):
    from ..verl.checkpoint_config import SlimCheckpointConfig

    config = manager.checkpoint_config
    if not isinstance(config, SlimCheckpointConfig):
        return original(manager, local_path, hdfs_path, global_step, max_ckpt_to_keep)
    if config.incremental_save:
        from .resume_state import save_resume_state

        return save_resume_state(original, manager, local_path, hdfs_path, global_step, max_ckpt_to_keep)
    result = original(manager, local_path, hdfs_path, global_step, max_ckpt_to_keep)
    if config.export_hf:
        from .hf_export import export_hf_from_shards

        export_hf_from_shards(local_path, config.export_dtype, config.max_shard_size)
    return result
