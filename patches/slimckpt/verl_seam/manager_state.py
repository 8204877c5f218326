"""What slimckpt keeps per FSDPCheckpointManager across saves and loads, in one typed place.

A manager gets one `ManagerState` (its checkpoint group, background writer, the outcome of its
last save, retention's deferral, the once-only notes, the export's HF side, its config resolved
as a SlimCheckpointConfig), in a single attribute of the manager, so verl's own attributes are
never shadowed and a manager dropped by verl takes its state with it. The driver's objects have
theirs in driver_state.
"""

# lazy imports: the config class (it subclasses verl's, so it imports verl) only when a config is resolved;
# the staging pool imports this module and runs where verl is not installed (slimckpt.testing.gpu_check)
from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .checkpoint_config import SlimCheckpointConfig

_ATTR = "_slimckpt_state"
_LOCK = threading.Lock()  # the background writer and the trainer's thread may both ask first
_DEFAULTS: list[SlimCheckpointConfig] = []


@dataclass
class ManagerState:
    """slimckpt's state of one FSDPCheckpointManager."""

    group: Any = None
    """The gloo group of the manager's ranks for DCP's coordination and the commit (save.process_group)."""
    writer: Any = None
    """Its background writer (save.resume_async.AsyncResumeWriter), made at its first incremental save."""
    save_failed: str | None = None
    """The one-line error of its last save when it failed (save.errors), else None."""
    retention_deferred: bool = False
    """True while verl's own save runs inside the incremental tier's: retention waits for the commit."""
    hf_side: Any = None
    """The export's hf.naming.HfSide: the model's structure does not change during a run."""
    noted: set[str] = field(default_factory=set)
    """The once-per-manager log lines already said (note_once)."""
    _config: SlimCheckpointConfig | None = None
    _config_source: Any = None

    def note_once(self, what: str) -> bool:
        """True the first time `what` is asked for on this manager."""
        if what in self.noted:
            return False
        self.noted.add(what)
        return True


def state_of(manager: Any) -> ManagerState:
    """The manager's ManagerState, made on first use."""
    state = manager.__dict__.get(_ATTR)
    if state is None:
        with _LOCK:
            state = manager.__dict__.get(_ATTR)
            if state is None:
                state = ManagerState()
                setattr(manager, _ATTR, state)
    return state


def default_config() -> SlimCheckpointConfig:
    """The dataclass's defaults, for a manager whose config is verl's own (no recipe)."""
    from .checkpoint_config import SlimCheckpointConfig

    if not _DEFAULTS:
        _DEFAULTS.append(SlimCheckpointConfig.defaults())
    return _DEFAULTS[0]


def config_of(manager: Any) -> SlimCheckpointConfig:
    """The manager's checkpoint config as a SlimCheckpointConfig: a recipe's own, or the defaults
    where verl's config has none of slimckpt's fields. Resolved again when the manager's config is
    replaced (a test or tool swapping recipes on one manager)."""
    from .checkpoint_config import SlimCheckpointConfig

    state = state_of(manager)
    raw = getattr(manager, "checkpoint_config", None)
    if state._config is None or state._config_source is not raw:
        state._config = raw if isinstance(raw, SlimCheckpointConfig) else default_config()
        state._config_source = raw
    return state._config


__all__ = ["ManagerState", "config_of", "default_config", "state_of"]
