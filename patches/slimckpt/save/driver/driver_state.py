"""What slimckpt keeps on verl's driver-side objects (the trainer, its tracking logger), in one
typed place: a single attribute of the object, never one of verl's own names. Torch-free, as the
driver's hooks that use it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

_ATTR = "_slimckpt_driver_state"


@dataclass
class DriverState:
    """slimckpt's state of a driver-side object."""

    watcher: Any = None
    """The trainer's tracker.CommitWatcher (async saves), made at its first save."""
    metrics_root: str | None = None
    """The tracking logger's default_local_dir, where keep_best records each save step's metrics."""


def driver_state_of(obj: Any) -> DriverState:
    """The object's DriverState, made on first use (the driver's hooks run on one thread)."""
    state = obj.__dict__.get(_ATTR)
    if state is None:
        state = DriverState()
        setattr(obj, _ATTR, state)
    return state


__all__ = ["DriverState", "driver_state_of"]
