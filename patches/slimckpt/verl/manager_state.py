"""What slimckpt keeps per FSDPCheckpointManager across saves and loads, and its config resolved.

A manager gets one `TargetState` (the engine's: its checkpoint group, background writer, the outcome
of its last save, retention's deferral, the once-only notes, the export's HF side) in a single
attribute of the manager, so verl's own attributes are never shadowed and a manager dropped by
verl takes its state with it. The driver's objects have theirs in save.driver_state.
"""

# lazy imports: the config class (it subclasses verl's, so it imports verl) only when a config is resolved
from __future__ import annotations

import threading
from typing import TYPE_CHECKING, Any

from slimckpt.save.target import TargetState

if TYPE_CHECKING:
    from slimckpt.verl.checkpoint_config import SlimCheckpointConfig

_ATTR = "_slimckpt_state"
_LOCK = threading.Lock()  # the background writer and the trainer's thread may both ask first
_DEFAULTS: list[SlimCheckpointConfig] = []


def state_of(manager: Any) -> TargetState:
    """The manager's TargetState, made on first use."""
    state = manager.__dict__.get(_ATTR)
    if state is None:
        with _LOCK:
            state = manager.__dict__.get(_ATTR)
            if state is None:
                state = TargetState()
                setattr(manager, _ATTR, state)
    return state


def default_config() -> SlimCheckpointConfig:
    """The dataclass's defaults, for a manager whose config is verl's own (no recipe)."""
    from slimckpt.verl.checkpoint_config import SlimCheckpointConfig

    if not _DEFAULTS:
        _DEFAULTS.append(SlimCheckpointConfig.defaults())
    return _DEFAULTS[0]


def config_of(manager: Any) -> SlimCheckpointConfig:
    """The manager's checkpoint config as a SlimCheckpointConfig: a recipe's own, or the defaults
    where verl's config has none of slimckpt's fields (a test or tool may swap a manager's config)."""
    from slimckpt.verl.checkpoint_config import SlimCheckpointConfig

    raw = getattr(manager, "checkpoint_config", None)
    return raw if isinstance(raw, SlimCheckpointConfig) else default_config()


__all__ = ["config_of", "default_config", "state_of"]
