"""The record that retention dropped a step's optimizer state (keep_optimizer_last). No torch.

Such a step is not damaged: it is a committed step that holds less. Every reader asks here:

  incremental tier (dcp/)   the step's manifest says so: `contents` lose "optimizer" and
                            `extra["optimizer_dropped"]` records when and how many bytes. The
                            manifest is rewritten (sealed, every file listed) by the same atomic
                            rename that commits a save, so `slimckpt verify` checks it as any step.
  verl's rank files         `slimckpt_optimizer_dropped.json` next to them, written before the first
                            `optim_world_size_*` file is deleted: a delete cut short leaves the
                            record, and the next retention pass finishes it.
"""

from __future__ import annotations

import json
import os
from typing import Any

from slimckpt.layout.resume_manifest import MANIFEST_NAME, UncommittedCheckpoint, read_manifest

DROPPED_KEY = "optimizer_dropped"  # manifest.extra of an incremental step
NATIVE_MARKER = "slimckpt_optimizer_dropped.json"  # verl's format: next to the rank files


def optimizer_dropped(role_dir: str) -> dict[str, Any] | None:
    """What retention recorded when it dropped this role dir's optimizer state, or None when it did not."""
    marker = os.path.join(role_dir, NATIVE_MARKER)
    if os.path.isfile(marker):
        try:
            with open(marker, encoding="utf-8") as f:
                data = json.load(f)
            return data if isinstance(data, dict) else {"record": marker}
        except (OSError, ValueError):
            return {"record": marker}  # cut short while written: the delete had not begun
    if os.path.isfile(os.path.join(role_dir, MANIFEST_NAME)):
        try:
            record = read_manifest(role_dir).extra.get(DROPPED_KEY)
        except UncommittedCheckpoint:
            return None
        return dict(record) if isinstance(record, dict) else None
    return None


def resume_line(role_dir: str, loads: list[str]) -> str:
    """The one line a resume from such a step prints; `loads`: what it still loads (model, extra)."""
    record = optimizer_dropped(role_dir) or {}
    kept = record.get("keep_optimizer_last")
    why = f" (keep_optimizer_last={kept}: only the newest {kept} steps keep it)" if kept else ""
    what = {"model": "model", "extra": "lr schedule and RNG"}
    loaded = " and ".join(what[c] for c in ("model", "extra") if c in loads) or "nothing"
    return (
        f"slimckpt: {role_dir} has no optimizer state, retention dropped it{why}: resuming its {loaded}; the "
        f"optimizer starts afresh (Adam moments and step count from zero)"
    )


__all__ = ["DROPPED_KEY", "NATIVE_MARKER", "optimizer_dropped", "resume_line"]
