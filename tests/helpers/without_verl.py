"""Run a child interpreter in which verl, Ray, omegaconf and hydra cannot be imported, as on a GPU image
that has torch and nothing of verl's stack.

A `sitecustomize.py` on the child's PYTHONPATH puts a finder first on `sys.meta_path` that refuses those
packages, so every process the child starts (torchrun ranks, spawned workers) inherits the block.
"""

from __future__ import annotations

import os
from pathlib import Path

BLOCKED = ("verl", "ray", "omegaconf", "hydra")

_SITECUSTOMIZE = f'''"""Written by tests/helpers/without_verl.py: {", ".join(BLOCKED)} cannot be imported here."""
import sys

BLOCKED = {BLOCKED!r}


class VerlStackBlocker:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in BLOCKED:
            raise ModuleNotFoundError(f"No module named {{name!r}} (blocked: this process runs without verl)", name=name)
        return None


sys.meta_path.insert(0, VerlStackBlocker())
'''


def env_without_verl(where: Path) -> dict[str, str]:
    """Environment additions for a child without verl's stack (`where`: a fresh directory for the hook)."""
    where.mkdir(parents=True, exist_ok=True)
    (where / "sitecustomize.py").write_text(_SITECUSTOMIZE)
    rest = os.environ.get("PYTHONPATH", "")
    return {"PYTHONPATH": os.pathsep.join(p for p in (str(where), rest) if p)}


__all__ = ["BLOCKED", "env_without_verl"]
