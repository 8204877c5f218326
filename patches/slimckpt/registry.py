"""The patch registry: every change slimckpt makes to verl, with its verl version guard.

A patch names one attribute of verl (`module:Attr.path`), the feature that switches it on and the
verl versions it was written against. Applying it swaps the attribute and logs one line; reverting
puts the original back. An installed verl outside a patch's range raises UnsupportedVerlVersion
naming both versions: we never fall back silently to behaviour nobody tested.
"""

from __future__ import annotations

import importlib
import os
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from types import ModuleType
from typing import Any

from packaging.specifiers import SpecifierSet
from packaging.version import Version

from . import SUPPORTED_VERL, __version__
from .import_hooks import cancel, when_imported
from .log import get_logger

log = get_logger("slimckpt.registry")

ALLOW_ENV = "SLIMCKPT_ALLOW_UNTESTED_VERL"


class UnsupportedVerlVersion(RuntimeError):
    pass


def installed_verl_version() -> str:
    """verl's version without importing verl (the plugin runs while `import verl` is under way)."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("verl")
    except PackageNotFoundError as exc:  # pragma: no cover - slimckpt depends on verl
        raise UnsupportedVerlVersion("verl is not installed; slimckpt needs verl" + SUPPORTED_VERL) from exc


def check_verl_version(spec: str = SUPPORTED_VERL, installed: str | None = None) -> str:
    installed = installed or installed_verl_version()
    if Version(installed) in SpecifierSet(spec):
        return installed
    if os.environ.get(ALLOW_ENV) == installed:
        log.warning("verl %s is outside slimckpt %s's tested range (verl%s); %s=%s says go ahead",
                    installed, __version__, spec, ALLOW_ENV, installed)
        return installed
    raise UnsupportedVerlVersion(
        f"slimckpt {__version__} supports verl{spec} but verl {installed} is installed: "
        f"install verl{spec}, or set SLIMCKPT_DISABLE=1 to run plain verl "
        f"(or {ALLOW_ENV}={installed} to try anyway)"
    )


@dataclass(frozen=True)
class Patch:
    """One replaced attribute of verl.

    `make(original)` returns the replacement; it receives verl's original so a patch can wrap
    or delegate to it.
    """

    name: str
    target: str
    feature: str
    make: Callable[[Any], Any]
    why: str
    verl_versions: str = SUPPORTED_VERL

    @property
    def module_name(self) -> str:
        return self.target.split(":", 1)[0]

    @property
    def attr_path(self) -> list[str]:
        return self.target.split(":", 1)[1].split(".")


def resolve(target: str) -> tuple[Any, str, Any]:
    """`module:A.b` -> (owner object, attribute name, current value). Imports the module."""
    module_name, _, path = target.partition(":")
    owner: Any = importlib.import_module(module_name)
    parts = path.split(".")
    for part in parts[:-1]:
        owner = getattr(owner, part)
    return owner, parts[-1], getattr(owner, parts[-1])


@dataclass
class _Applied:
    owner: Any
    attr: str
    original: Any
    had_own_attr: bool


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
        owner, attr, original = resolve(patch.target)
        had_own = attr in vars(owner) if hasattr(owner, "__dict__") else True
        setattr(owner, attr, patch.make(original))
        self._applied[name] = _Applied(owner, attr, original, had_own)
        self._pending.discard(name)
        log.info("patched %s (%s) [verl %s]", patch.target, patch.why, verl)

    def apply_on_import(self, name: str) -> None:
        """Apply as soon as the target module is imported (at once if it already is)."""
        patch = self.get(name)
        if name in self._applied or name in self._pending:
            return
        check_verl_version(patch.verl_versions)
        self._pending.add(name)

        def _apply(_module: ModuleType) -> None:
            if name in self._pending:
                self.apply(name)

        when_imported(patch.module_name, _apply)

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
        if state.had_own_attr:
            setattr(state.owner, state.attr, state.original)
        else:
            delattr(state.owner, state.attr)
        log.info("reverted %s", self._patches[name].target)

    def revert_all(self, names: Iterable[str] | None = None) -> None:
        for name in list(names if names is not None else [*self._applied, *self._pending]):
            self.revert(name)
        if names is None:
            for patch in self._patches.values():
                cancel(patch.module_name)


REGISTRY = Registry()
