"""Deprecated path, kept for launch commands written before the package was split into stages:
`trainer.checkpoint_callback_class=slimckpt.ckpt_metrics.CheckpointMetricsCallback` names the same
class as `slimckpt.observe.ckpt_metrics.CheckpointMetricsCallback`."""

from .observe.ckpt_metrics import CheckpointMetricsCallback

__all__ = ["CheckpointMetricsCallback"]
