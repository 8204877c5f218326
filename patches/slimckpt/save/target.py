"""What a save or a load needs from its caller, as one object: the SaveTarget.

The engine (this wing) never reads a trainer's checkpoint manager. verl's `FSDPCheckpointManager`
is turned into a SaveTarget in the verl wing (`slimckpt.verl.save_target.target_of`) at each
save and load; a caller without verl (the GPU check, a test, another trainer) builds one directly
from its model and optimizer. What the engine keeps between saves of one target (its checkpoint
group, background writer, once-only notes) is its `TargetState`, which the caller keeps alive for
as long as it saves (verl's wing keeps it on the manager).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from torch.distributed.fsdp import FSDPModule, FullyShardedDataParallel

from slimckpt.layout.names import SHARD_CONTENTS
from slimckpt.options.checkpoint_options import CheckpointOptions


@dataclass
class TargetState:
    """What the engine keeps across the saves and loads of one target."""

    group: Any = None
    """The gloo group of the target's ranks for DCP's coordination and the commit (save.process_group)."""
    writer: Any = None
    """Its background writer (save.modes.writer.AsyncResumeWriter), made at its first incremental save."""
    save_failed: str | None = None
    """The one-line error of its last save when it failed (save.errors), else None."""
    retention_deferred: bool = False
    """True while the caller's own save runs inside the incremental tier's: retention waits for the commit."""
    hf_side: Any = None
    """The export's hf.naming.HfSide: the model's structure does not change during a run."""
    noted: set[str] = field(default_factory=set)
    """The once-per-target log lines already said (note_once)."""

    def note_once(self, what: str) -> bool:
        """True the first time `what` is asked for on this target."""
        if what in self.noted:
            return False
        self.noted.add(what)
        return True


def _no_rng() -> None:
    return None


@dataclass(frozen=True)
class SaveTarget:
    """The model, optimizer and settings one save or load works on, and the caller's hooks.

    `save_contents`/`load_contents` say what is saved or loaded (model, optimizer, extra; the
    caller's own kinds, such as verl's hf_model, pass through to `side_files`)."""

    model: Any
    """The FSDP-wrapped module (FSDP1 or FSDP2)."""
    optimizer: Any
    """Its optimizer, or None."""
    options: CheckpointOptions
    """slimckpt's settings for this target."""
    state: TargetState
    """What the engine keeps between this target's saves."""
    rank: int = 0
    world_size: int = 1
    lr_scheduler: Any = None
    save_contents: tuple[str, ...] = SHARD_CONTENTS
    load_contents: tuple[str, ...] = SHARD_CONTENTS
    fsdp_version: int = 2
    """1 (FullyShardedDataParallel), 2 (fully_shard), 0 (neither): recorded in the manifest."""
    get_rng_state: Callable[[], Any] = _no_rng
    """This rank's RNG state, saved with the extra state (None: nothing to restore)."""
    load_rng_state: Callable[[Any], None] | None = None
    lora_only: bool = False
    """Save only the LoRA adapter's parameters (verl's save_lora_only on a peft model)."""
    lora_train_meta: Callable[[Any], Any] | None = None
    """The adapter's rank and alpha from the unwrapped module, for a merged LoRA export."""
    trust_remote_code: bool = False
    """Whether the export may run the model's own config code (Hugging Face's trust_remote_code)."""
    saved_paths: list[str] = field(default_factory=list)
    """The steps retention tracks, oldest first; updated in place as steps are committed and pruned."""
    side_files: Callable[[str, list[str]], None] | None = None
    """Writes the caller's own files into a step's dir for the given contents (verl's huggingface/
    configs, fsdp_config.json, an hf_model save), with retention deferred; None: the step holds
    slimckpt's files only."""

    @property
    def should_save_model(self) -> bool:
        return "model" in self.save_contents

    @property
    def should_save_optimizer(self) -> bool:
        return "optimizer" in self.save_contents

    @property
    def should_save_extra(self) -> bool:
        return "extra" in self.save_contents

    @property
    def should_load_model(self) -> bool:
        return "model" in self.load_contents

    @property
    def should_load_optimizer(self) -> bool:
        return "optimizer" in self.load_contents

    @property
    def should_load_extra(self) -> bool:
        return "extra" in self.load_contents

    def loading(self, contents: list[str]) -> SaveTarget:
        """The same target, loading only `contents`."""
        return dataclasses.replace(self, load_contents=tuple(contents))


def fsdp_version_of(model: Any) -> int:
    """1 for FullyShardedDataParallel, 2 for a fully_shard module, 0 otherwise (the manifest's record)."""
    if isinstance(model, FullyShardedDataParallel):
        return 1
    return 2 if isinstance(model, FSDPModule) else 0


__all__ = ["SaveTarget", "TargetState", "fsdp_version_of"]
