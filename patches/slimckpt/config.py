"""Deprecated path, kept for configs written before the package was split into stages:
`_target_: slimckpt.config.SlimCheckpointConfig` builds the same class as the recipes' current
`slimckpt.verl.checkpoint_config.SlimCheckpointConfig`."""

from .verl.checkpoint_config import RECIPES, SlimCheckpointConfig

__all__ = ["RECIPES", "SlimCheckpointConfig"]
