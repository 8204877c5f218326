"""verl's own helpers for a merge's Hugging Face side, loaded from verl's installed files without
running `verl/__init__.py`.

`import verl` imports Ray, `DataProto` and torch.distributed's elastic agent before any of its
modules: 0.6-1.0 s of a 1B `slimckpt merge`'s 4-6 s here, spent on the path the commit waits for.
The merge needs three of verl's modules, and none of them imports anything from verl: tokenizer
and processor loading (`utils/tokenizer/tokenizer.py`), dropping tied keys
(`utils/transformers_compat.py`) and the output check (`model_merger/output_validation.py`).
Loading those files by path runs verl's exact code, so the output stays verl's.

Only for the verl versions the registry knows (the same guard and message as every patch): another
verl may have moved or changed these files, and nobody checked that they still stand alone.
"""

from __future__ import annotations

import importlib.util
import os
import sys
from types import ModuleType

from slimckpt.verl_files.version import UnsupportedVerlVersion, check_verl_version

# name -> path inside the installed verl package (verl 0.9.1's layout)
LEAVES = {
    "tokenizer": os.path.join("utils", "tokenizer", "tokenizer.py"),
    "transformers_compat": os.path.join("utils", "transformers_compat.py"),
    "output_validation": os.path.join("model_merger", "output_validation.py"),
}
_PREFIX = "_slimckpt_verl_leaf_"


def verl_dir() -> str:
    """The installed verl package's directory, found without importing verl."""
    spec = importlib.util.find_spec("verl")
    if spec is None or not spec.submodule_search_locations:
        raise UnsupportedVerlVersion("verl is not installed; slimckpt needs it (pip install verl==0.9.1)")
    return list(spec.submodule_search_locations)[0]


def leaf(name: str) -> ModuleType:
    """One of LEAVES, executed once per process under a private module name."""
    key = _PREFIX + name
    module = sys.modules.get(key)
    if module is not None:
        return module

    check_verl_version()
    path = os.path.join(verl_dir(), LEAVES[name])
    spec = importlib.util.spec_from_file_location(key, path)
    if spec is None or spec.loader is None:  # pragma: no cover - a file we just joined to verl's dir
        raise ImportError(f"cannot load {path}")
    module = importlib.util.module_from_spec(spec)
    sys.modules[key] = module  # before exec, as the import system does (dataclasses look themselves up)
    try:
        spec.loader.exec_module(module)
    except BaseException:
        del sys.modules[key]
        raise
    return module
