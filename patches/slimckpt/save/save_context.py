"""One save of the incremental tier, as every phase after the plan sees it.

Built once in the foreground (resume_save) and handed, whole, to the write and the commit, which
may run on the background writer's thread: what the save is (target, role dir, step, contents),
where it agrees with the other ranks (group), how it writes (config), and what the plan decided
(tied-weight aliases, the HF export's plan, the stream capture, retention's optimizer drops).
`timings` is the one mutable part: each phase adds its seconds, and the manifest records them.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from slimckpt.engine.checkpoint_dir import DCP_DIR
from slimckpt.options.checkpoint_options import CheckpointOptions
from slimckpt.save.target import SaveTarget


@dataclass(frozen=True)
class SaveContext:
    target: SaveTarget
    """What is saved (model, optimizer, ranks, the caller's hooks)."""
    local_path: str
    """The role dir (`<root>/global_step_N/actor`)."""
    step: int
    """The global step being saved."""
    group: Any
    """The manager's checkpoint group (process_group.checkpoint_group): every collective of the save."""
    config: CheckpointOptions
    """The target's options."""
    contents: list[str]
    """The shard contents saved: model, optimizer, extra (of checkpoint.save_contents)."""
    max_keep: int | None = None
    """verl's max_ckpt_to_keep, for retention after the commit."""
    timings: dict[str, float] = field(default_factory=dict)
    """Seconds of each phase, recorded in the manifest."""
    aliases: dict[str, str] = field(default_factory=dict)
    """Tied weights: alias -> the name written (state_dicts.split_aliases)."""
    lora_only: bool = False
    """verl's save_lora_only: the step holds the adapter's parameters."""
    export: Any = None
    """The gather-free HF export's plan (hf_direct_export.plan_export), or None without export_hf."""
    capture: Any = None
    """async_save=stream: the StreamCapture the writer reads the live shards through."""
    first: Callable[[], None] | None = None
    """Rank 0: retention's optimizer drops, run before the shards (where the save writes)."""

    @property
    def dcp_dir(self) -> str:
        return os.path.join(self.local_path, DCP_DIR)


__all__ = ["SaveContext"]
