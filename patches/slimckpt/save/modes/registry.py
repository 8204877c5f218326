"""The one place a config's async_save picks its mode: name -> class, one line per mode."""

from __future__ import annotations

from typing import Any, get_args

from slimckpt.options.checkpoint_options import AsyncSave
from slimckpt.save.modes.base import AsyncMode
from slimckpt.save.modes.pool import PoolMode
from slimckpt.save.modes.stream import StreamMode
from slimckpt.save.modes.sync import SyncMode

MODES: dict[str, type[AsyncMode]] = {
    SyncMode.name: SyncMode,
    PoolMode.name: PoolMode,
    StreamMode.name: StreamMode,
}

# the names a checked config may hold, and none else: a mode the config spells and no class
# implements (or the reverse) fails here, at import, not at its first save
if set(MODES) != set(get_args(AsyncSave)):
    raise ImportError(
        f"slimckpt: async_save modes {sorted(MODES)} differ from the config's AsyncSave {sorted(get_args(AsyncSave))}"
    )


def mode_named(name: str) -> AsyncMode:
    """The mode `name` (as a checked config holds it: off, pool, stream)."""
    return MODES[name]()


def mode_for(config: Any) -> AsyncMode:
    """The mode a checked SlimCheckpointConfig saves with (its async_save)."""
    return mode_named(config.async_save)


__all__ = ["MODES", "mode_for", "mode_named"]
