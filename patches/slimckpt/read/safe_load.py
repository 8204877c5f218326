"""`torch.load` of a checkpoint file with pickle_policy's globals only.

A file is checked with pickle_policy first (the refusal names the file and the global, whatever
torch's message says), then loaded by torch's own restricted loader (`weights_only=True`) allowed
pickle_policy's globals: what verl's extra state holds (lr scheduler, torch/numpy/Python RNG
states) loads; nothing outside the list is ever looked up.
"""

from __future__ import annotations

import functools
import pickle
import re
import warnings
from typing import Any

from .pickle_policy import PickleRefused, check_file, torch_safe_globals, trusted

_TORCH_REFUSAL = re.compile(r"GLOBAL (\S+) was not an allowed global")


@functools.lru_cache(maxsize=1)
def _safe_globals() -> tuple:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # numpy.core is deprecated under numpy 2 (numpy._core)
        return tuple(torch_safe_globals())


def load_torch_file(path: str, **kwargs: Any) -> Any:
    """torch.load(path) with pickle_policy's globals only; raises PickleRefused (or what torch raises)."""
    import torch

    if trusted():
        return torch.load(path, weights_only=False, **kwargs)
    check_file(path)
    try:
        with torch.serialization.safe_globals(list(_safe_globals())):
            return torch.load(path, weights_only=True, **kwargs)
    except pickle.UnpicklingError as exc:
        m = _TORCH_REFUSAL.search(str(exc))
        if m:
            raise PickleRefused(path, m.group(1)) from None
        raise
