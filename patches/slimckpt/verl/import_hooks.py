"""Run a callback right after a module is imported, or at once if it already is.

Patches target heavy verl modules (the model merger pulls in transformers); hooking their import
instead of importing them eagerly keeps `import verl` as fast as without slimckpt.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
import threading
from collections.abc import Callable
from types import ModuleType

_lock = threading.RLock()
_hooks: dict[str, list[Callable[[ModuleType], None]]] = {}


class _HookedLoader(importlib.abc.Loader):
    def __init__(self, loader: importlib.abc.Loader, fullname: str) -> None:
        self._loader = loader
        self._fullname = fullname

    def create_module(self, spec: importlib.machinery.ModuleSpec):  # type: ignore[override]
        return self._loader.create_module(spec)

    def exec_module(self, module: ModuleType) -> None:
        self._loader.exec_module(module)
        _run_hooks(self._fullname, module)

    def __getattr__(self, name: str):
        # get_source, get_filename, is_package ... keep working for inspect and tracebacks
        return getattr(self._loader, name)


class _PostImportFinder(importlib.abc.MetaPathFinder):
    def __init__(self) -> None:
        self._busy = threading.local()

    def find_spec(self, fullname, path, target=None):
        if fullname not in _hooks:
            return None
        busy = getattr(self._busy, "names", None)
        if busy is None:
            busy = self._busy.names = set()
        if fullname in busy:
            return None
        busy.add(fullname)
        try:
            for finder in sys.meta_path:
                if finder is self or not hasattr(finder, "find_spec"):
                    continue
                spec = finder.find_spec(fullname, path, target)
                if spec is not None:
                    break
            else:
                return None
        finally:
            busy.discard(fullname)
        if spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        spec.loader = _HookedLoader(spec.loader, fullname)
        return spec


_finder = _PostImportFinder()


def _run_hooks(fullname: str, module: ModuleType) -> None:
    with _lock:
        callbacks = _hooks.pop(fullname, [])
    for callback in callbacks:
        callback(module)


def when_imported(fullname: str, callback: Callable[[ModuleType], None]) -> None:
    """Call `callback(module)` once `fullname` is imported (now, if it already is)."""
    with _lock:
        module = sys.modules.get(fullname)
        if module is None:
            _hooks.setdefault(fullname, []).append(callback)
            if _finder not in sys.meta_path:
                sys.meta_path.insert(0, _finder)
            return
    callback(module)


def cancel(fullname: str) -> None:
    """Forget every callback still waiting for `fullname`."""
    with _lock:
        _hooks.pop(fullname, None)
