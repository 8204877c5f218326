"""The save wing's shared helpers: exact equality of RNG states, and whether two share a generator's state."""

from __future__ import annotations


def same_rng_state(a, b) -> bool:
    """Exact equality of RNG states (tensors, numpy arrays, nested tuples and dicts)."""
    import numpy as np
    import torch

    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, np.ndarray) or isinstance(b, np.ndarray):
        return isinstance(a, np.ndarray) and isinstance(b, np.ndarray) and a.dtype == b.dtype and np.array_equal(a, b)
    if isinstance(a, dict) and isinstance(b, dict):
        return set(a) == set(b) and all(same_rng_state(a[k], b[k]) for k in a)
    if isinstance(a, (tuple, list)) and isinstance(b, (tuple, list)):
        return len(a) == len(b) and all(same_rng_state(x, y) for x, y in zip(a, b))
    return type(a) is type(b) and a == b


def shares_a_generator(a: dict, b: dict) -> bool:
    return any(same_rng_state(a[k], b[k]) for k in a.keys() & b.keys())
