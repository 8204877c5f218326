"""A small checkpoint file (verl's extra state, slimckpt's) loaded with pickle_policy's globals only.

The one `.pt` reader (`pt_index`, tensors by `pt_tensors`) with its storages read into memory, as
`torch.load(map_location="cpu")` leaves them: what verl's extra state holds (lr scheduler,
torch/numpy/Python RNG states) loads; a global outside the list is refused (PickleRefused, naming
the file and the global) before it is looked up, and nothing else is ever looked up.
"""

from __future__ import annotations

from typing import Any

from slimckpt.engine import pt_tensors
from slimckpt.storage import for_path, is_url


def load_torch_file(path: str, map_location: str = "cpu") -> Any:
    """The object `path` holds, its tensors on the CPU; raises PickleRefused, pt_index.NotATorchFile
    (not what torch.save writes) or OSError."""
    if map_location != "cpu":
        raise ValueError(f"load_torch_file loads onto the CPU only, not {map_location!r}")
    if is_url(path):  # object storage: the whole (small) file read through its storage
        with for_path(path).open_read(path) as f:
            return pt_tensors.load_bytes(f.read(), path)
    return pt_tensors.load(path, access=None)
