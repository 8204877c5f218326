"""Every patch slimckpt applies to verl, in one place.

Each entry names the verl attribute it replaces, the feature that switches it on (see
`slimckpt.plugin`) and why. Implementations live in their own modules and are imported only
when a patch is applied. tests/test_registry.py freezes the set of targets, so an upstream
rename fails in CI instead of silently turning a patch off.
"""

from __future__ import annotations

from .registry import REGISTRY, Patch

CKPT_MANAGER = "verl.utils.checkpoint.fsdp_checkpoint_manager:FSDPCheckpointManager"


def _save_checkpoint(original):
    from .checkpoint_hooks import wrap_save_checkpoint

    return wrap_save_checkpoint(original)


PATCHES: list[Patch] = [
    Patch(
        name="checkpoint.save",
        target=f"{CKPT_MANAGER}.save_checkpoint",
        feature="checkpoint",
        make=_save_checkpoint,
        why="measure every save and route recipe saves through slimckpt",
    ),
]


def register_all() -> None:
    for patch in PATCHES:
        if patch.name not in {p.name for p in REGISTRY.patches()}:
            REGISTRY.register(patch)
