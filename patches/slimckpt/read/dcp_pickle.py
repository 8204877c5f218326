"""DCP's reader and load planner with pickle_policy in front of their unpickling.

torch.distributed.checkpoint unpickles two things with plain pickle: `dcp/.metadata`
(FileSystemReader.read_metadata: `pickle.load`) and every non-tensor record of the `.distcp`
files (DefaultLoadPlanner.load_bytes: `torch.load(weights_only=False)`: the optimizer's
param_groups and other Python values). Its tensor records it reads with `weights_only=True`
already. Here both are unpickled by pickle_policy's RestrictedUnpickler instead: `.metadata`
directly (what FileSystemReader does after its `pickle.load` is kept), a byte record by the one
`.pt` reader (`pt_tensors.load_bytes`), its value then set where DCP's planner sets it. A
booby-trapped step is refused (PickleRefused, naming the file and the global) before any of it runs.
"""

from __future__ import annotations

import io
import os

from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import StorageMeta

from . import pt_tensors
from .pickle_policy import PickleRefused, RestrictedUnpickler

METADATA_NAME = ".metadata"


class CheckedFileSystemReader(FileSystemReader):
    """FileSystemReader whose `.metadata` is unpickled with pickle_policy's globals only."""

    def read_metadata(self, *args, **kwargs):
        path = os.path.join(os.fspath(self.path), METADATA_NAME)
        with open(path, "rb") as f:
            unpickler = RestrictedUnpickler(f)
            unpickler.path = path
            metadata = unpickler.load()
        if getattr(metadata, "storage_meta", None) is None:  # as FileSystemReader.read_metadata does
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


class CheckedLoadPlanner(DefaultLoadPlanner):
    """DefaultLoadPlanner whose non-tensor records are unpickled with pickle_policy's globals only."""

    def __init__(self, dcp_dir: str, **kwargs) -> None:
        super().__init__(**kwargs)
        self.dcp_dir = dcp_dir

    def load_bytes(self, read_item, value: io.BytesIO) -> None:
        fqn = read_item.dest_index.fqn
        try:
            obj = pt_tensors.load_bytes(value.getvalue(), self.dcp_dir)
        except PickleRefused as exc:
            raise PickleRefused(exc.path, exc.global_name, f"the record of {fqn}") from None
        if self.flatten_state_dict:  # where DefaultLoadPlanner.load_bytes puts it
            _set_at(self.original_state_dict, self.mappings[fqn], obj)
        else:
            self.state_dict[fqn] = obj


def _set_at(root, path: tuple, value) -> None:
    """root[path[0]][path[1]]... = value, making the dicts (str keys) and lists (int keys) on the way
    that the state dict does not hold yet, lists padded with None."""
    node = root
    for key, after in zip(path, path[1:]):
        empty = {} if type(after) is str else []
        if isinstance(node, dict):
            node = node.setdefault(key, empty)
            continue
        node.extend([None] * (key + 1 - len(node)))
        if node[key] is None:
            node[key] = empty
        node = node[key]
    last = path[-1]
    if type(last) is int:
        node.extend([None] * (last + 1 - len(node)))
    node[last] = value


def read_metadata(dcp_dir: str):
    """DCP's Metadata of `dcp_dir`, its pickle checked first; raises PickleRefused or what DCP raises."""
    return CheckedFileSystemReader(dcp_dir).read_metadata()
