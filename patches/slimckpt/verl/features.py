"""Switching a feature on: the one way slimckpt's patches reach verl.

A feature is a set of entries of `patch_list.PATCHES` ("merge", "adopt", "measure", "checkpoint",
"cpu", "flowrl"). `switch_on` registers the list once, checks verl's version, then has the registry apply the
feature's patches as their verl modules are imported. Who switches what on: the plugin (on every
`import verl`, from the environment), a recipe's SlimCheckpointConfig ("checkpoint", where verl
builds it) and FlowRLLossConfig ("flowrl").
"""

from __future__ import annotations

from slimckpt.verl.patch_list import PATCHES
from slimckpt.verl.registry import REGISTRY, check_verl_version


def register_all() -> None:
    """Put every entry of the patch list into the registry (idempotent)."""
    known = {p.name for p in REGISTRY.patches()}
    for patch in PATCHES:
        if patch.name not in known:
            REGISTRY.register(patch)


def switch_on(feature: str) -> list[str]:
    """Apply `feature`'s patches in this process (idempotent); returns their names."""
    register_all()
    check_verl_version()
    return REGISTRY.apply_feature(feature)
