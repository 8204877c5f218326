"""Which keys of a config verl 0.9.1 actually has.

Hydra merges a `# @package _global_` group file (a recipe, an override) into verl's config
without struct checking: a misspelt `trainer.save_freqq: 10` in a recipe is silently added and
never read. Command-line `+key=value` does the same on purpose. Sections with a `_target_` are
later built into dataclasses, which reject unknown fields; everything else (trainer, data, ...)
is read with `.get` and ignores them. This module finds such keys before a run.

A dotted key is *known* when it exists in verl's composed base config, or when it sits below a
section whose `_target_` dataclass declares the first missing component as a field, or below a
free-form mapping (an empty `{}` in verl's config, such as `override_config` or `engine_kwargs`,
or one of FREE_FORM: sections verl passes through as keyword arguments).
"""

from __future__ import annotations

import dataclasses
import importlib
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

# passed on as **kwargs (ray.init), so any key is legitimate there
FREE_FORM = ("ray_kwargs.ray_init",)


def flatten_keys(node: Any, prefix: str = "") -> list[str]:
    """Dotted paths of every leaf (and every empty mapping) of a plain or OmegaConf mapping."""
    if isinstance(node, DictConfig):
        node = OmegaConf.to_container(node, resolve=False)
    if not isinstance(node, dict) or not node:
        return [prefix] if prefix else []
    keys: list[str] = []
    for key, value in node.items():
        path = f"{prefix}.{key}" if prefix else str(key)
        keys.extend(flatten_keys(value, path) if isinstance(value, dict) and value else [path])
    return keys


def is_known(base, dotted: str, overlay: Any = None) -> bool:
    """True if verl's config (`base`, composed without slimckpt's groups) has or accepts `dotted`.

    `overlay` is the file that sets the key: its own `_target_` at a level (a recipe swapping in
    SlimCheckpointConfig) decides which dataclass fields are accepted there.
    """
    node: Any = base
    over: Any = overlay
    parts = dotted.split(".")
    for i, part in enumerate(parts):
        here = ".".join(parts[:i])
        if here in FREE_FORM:
            return True
        if not isinstance(node, DictConfig):
            # below a leaf or a list: verl has nothing there (a leaf that is None may hold a mapping later)
            return node is None
        target = _get(over, "_target_") or (node.get("_target_") if "_target_" in node else None)
        if part in node:
            if target and _get(over, "_target_") and part not in _dataclass_fields(str(target)):
                return False  # the overlay's own dataclass lacks a field verl's default one has
            node = node._get_node(part)
            over = _get(over, part)
            if node is not None and hasattr(node, "_is_none") and node._is_none():
                return True  # verl leaves it None for a user-supplied value of any shape
            continue
        if len(node) == 0:
            return True  # an empty mapping in verl's config is a free-form one
        return bool(target) and part in _dataclass_fields(str(target))
    return True


def _get(mapping: Any, key: str) -> Any:
    try:
        return mapping.get(key) if mapping is not None and hasattr(mapping, "get") else None
    except Exception:
        return None


def unknown_keys(base, keys: list[str], overlay: Any = None) -> list[str]:
    return [k for k in keys if k and not k.endswith("_target_") and not is_known(base, k, overlay)]


def unknown_keys_in_file(base, path: Path) -> list[str]:
    """Keys a `# @package _global_` YAML file sets that verl's config does not have."""
    overlay = OmegaConf.load(path)
    return unknown_keys(base, flatten_keys(overlay), overlay)


def _dataclass_fields(target: str) -> set[str]:
    module_name, _, attr = target.rpartition(".")
    try:
        cls = getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError, ValueError):
        return set()  # building the section will report the bad _target_
    if not dataclasses.is_dataclass(cls):
        return set()
    return {f.name for f in dataclasses.fields(cls)}
