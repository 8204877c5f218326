"""The patch registry: every change slimckpt makes to verl, with its verl version guard.

A patch names one attribute of verl (`module:Attr.path`) or one entry of a verl table, the feature
that switches it on and the verl versions it was written against. Applying it swaps the attribute
(or adds the entry) and logs one line; reverting puts the original back. An installed verl outside
a patch's range raises UnsupportedVerlVersion naming both versions: we never fall back silently to
behaviour nobody tested.
"""

from __future__ import annotations

import builtins
import importlib
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from types import ModuleType
from typing import Any

from slimckpt import SUPPORTED_VERL
from slimckpt.log import get_logger
from slimckpt.verl.import_hooks import cancel, when_imported
from slimckpt.verl_files.version import check_verl_version

log = get_logger("slimckpt.registry")


@dataclass(frozen=True)
class Patch:
    """One change to verl: a replaced attribute, or an entry added to one of verl's tables.

    `make` builds the new value: a callable, or the `module:function` path of one in slimckpt,
    imported only when the patch is applied (so this list imports none of the code it names).
    Without `key`, `target` is the attribute replaced and `make(original)` returns the replacement
    (it receives verl's original so that it can wrap or delegate to it). With `key`, `target` is a
    table of verl's (a dict, e.g. a registry of platforms or losses) and the patch adds the entry at
    that path of keys (nested tables): `make(table)` returns its value, given the innermost table.
    `after` names the module whose import fills that table, when another module defines it.
    """

    name: str
    target: str
    feature: str
    make: Callable[[Any], Any] | str
    why: str
    verl_versions: str = SUPPORTED_VERL
    key: tuple = ()
    after: str | None = None

    @property
    def module_name(self) -> str:
        return self.target.split(":", 1)[0]

    @property
    def attr_path(self) -> list[str]:
        return self.target.split(":", 1)[1].split(".")

    @property
    def trigger_module(self) -> str:
        """The module whose import makes the patch applicable."""
        return self.after or self.module_name

    def builder(self) -> Callable[[Any], Any]:
        if callable(self.make):
            return self.make
        module_name, _, attr = self.make.partition(":")
        return getattr(importlib.import_module(module_name), attr)


def resolve(target: str) -> tuple[Any, str, Any]:
    """`module:A.b` -> (owner object, attribute name, current value). Imports the module.

    `module:open` (a builtin the module calls by name, with no global of its own) resolves to the
    builtin: a patch then sets the module's own global, which shadows it there only, and its
    revert deletes that global again."""
    module_name, _, path = target.partition(":")
    owner: Any = importlib.import_module(module_name)
    parts = path.split(".")
    for part in parts[:-1]:
        owner = getattr(owner, part)
    name = parts[-1]
    if isinstance(owner, ModuleType) and not hasattr(owner, name) and hasattr(builtins, name):
        return owner, name, getattr(builtins, name)
    return owner, name, getattr(owner, name)


def resolve_table(patch: Patch) -> dict:
    """The innermost table an entry patch adds to (imports the modules it needs)."""
    if patch.after:
        importlib.import_module(patch.after)
    table = resolve(patch.target)[2]
    for k in patch.key[:-1]:
        table = table[k]
    if not isinstance(table, dict):
        raise TypeError(f"patch {patch.name!r}: {patch.target}{list(patch.key[:-1])} is not a table")
    return table


@dataclass
class _Applied:
    owner: Any
    attr: Any
    original: Any
    had_own_attr: bool
    entry: bool = False


@dataclass
class Registry:
    _patches: dict[str, Patch] = field(default_factory=dict)
    _applied: dict[str, _Applied] = field(default_factory=dict)
    _pending: set[str] = field(default_factory=set)

    def register(self, patch: Patch) -> Patch:
        if patch.name in self._patches:
            raise ValueError(f"patch {patch.name!r} is registered twice")
        if ":" not in patch.target:
            raise ValueError(f"patch {patch.name!r}: target must look like 'module:Attr.path', got {patch.target!r}")
        if not callable(patch.make) and ":" not in patch.make:
            raise ValueError(f"patch {patch.name!r}: make must be a callable or 'module:function', got {patch.make!r}")
        self._patches[patch.name] = patch
        return patch

    def patches(self, feature: str | None = None) -> list[Patch]:
        return [p for p in self._patches.values() if feature is None or p.feature == feature]

    def features(self) -> list[str]:
        return sorted({p.feature for p in self._patches.values()})

    def get(self, name: str) -> Patch:
        try:
            return self._patches[name]
        except KeyError:
            raise KeyError(f"no patch named {name!r}; known: {sorted(self._patches)}") from None

    def is_applied(self, name: str) -> bool:
        return name in self._applied

    def applied(self) -> list[str]:
        return list(self._applied)

    def apply(self, name: str) -> None:
        """Apply now, importing the target module."""
        patch = self.get(name)
        if name in self._applied:
            return
        verl = check_verl_version(patch.verl_versions)
        if patch.key:
            table = resolve_table(patch)
            slot = patch.key[-1]
            had = slot in table
            state = _Applied(table, slot, table.get(slot), had, entry=True)
            table[slot] = patch.builder()(table)
            where = f"{patch.target}[{', '.join(map(repr, patch.key))}]"
        else:
            owner, attr, original = resolve(patch.target)
            had_own = attr in vars(owner) if hasattr(owner, "__dict__") else True
            state = _Applied(owner, attr, original, had_own)
            setattr(owner, attr, patch.builder()(original))
            where = patch.target
        self._applied[name] = state
        self._pending.discard(name)
        log.info("patched %s (%s) [verl %s]", where, patch.why, verl)

    def apply_on_import(self, name: str) -> None:
        """Apply as soon as the module it needs is imported (at once if it already is)."""
        patch = self.get(name)
        if name in self._applied or name in self._pending:
            return
        check_verl_version(patch.verl_versions)
        self._pending.add(name)

        def _apply(_module: ModuleType) -> None:
            if name in self._pending:
                self.apply(name)

        when_imported(patch.trigger_module, _apply)

    def apply_feature(self, feature: str, lazy: bool = True) -> list[str]:
        names = [p.name for p in self.patches(feature)]
        if not names:
            raise KeyError(f"no patches for feature {feature!r}; known features: {self.features()}")
        for name in names:
            (self.apply_on_import if lazy else self.apply)(name)
        return names

    def revert(self, name: str) -> None:
        self._pending.discard(name)
        state = self._applied.pop(name, None)
        if state is None:
            return
        if state.entry:
            if state.had_own_attr:
                state.owner[state.attr] = state.original
            else:
                state.owner.pop(state.attr, None)
        elif state.had_own_attr:
            setattr(state.owner, state.attr, state.original)
        else:
            delattr(state.owner, state.attr)
        log.info("reverted %s", self._patches[name].target)

    def revert_all(self, names: Iterable[str] | None = None) -> None:
        # newest first: two patches of one attribute (measure.save, checkpoint.save) wrap each other
        for name in reversed(list(names if names is not None else [*self._applied, *self._pending])):
            self.revert(name)
        if names is None:
            for patch in self._patches.values():
                cancel(patch.trigger_module)


REGISTRY = Registry()
