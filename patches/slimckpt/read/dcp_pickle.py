"""DCP's reader and load planner with pickle_policy in front of their unpickling.

torch.distributed.checkpoint unpickles two things with plain pickle: `dcp/.metadata`
(FileSystemReader.read_metadata: `pickle.load`) and every non-tensor record of the `.distcp`
files (DefaultLoadPlanner.load_bytes: `torch.load(weights_only=False)`: the optimizer's
param_groups and other Python values). Its tensor records it reads with `weights_only=True`
already. Here `.metadata` is unpickled by pickle_policy's RestrictedUnpickler itself (what
FileSystemReader does after its `pickle.load` is kept), and a byte record is checked with
pickle_policy before DCP's planner unpickles it (it sets the value at its place in the nested
state dict with DCP's own private helpers), so a booby-trapped step is refused (PickleRefused,
naming the file and the global) before any of it runs.
"""

from __future__ import annotations

import io
import os

from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import StorageMeta

from .pickle_policy import PickleRefused, RestrictedUnpickler, check_torch_bytes

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
    """DefaultLoadPlanner whose non-tensor records are checked before DCP unpickles them."""

    def __init__(self, dcp_dir: str, **kwargs) -> None:
        super().__init__(**kwargs)
        self.dcp_dir = dcp_dir

    def load_bytes(self, read_item, value: io.BytesIO) -> None:
        try:
            check_torch_bytes(value.getvalue(), self.dcp_dir)
        except PickleRefused as exc:
            raise PickleRefused(exc.path, exc.global_name, f"the record of {read_item.dest_index.fqn}") from None
        value.seek(0)
        super().load_bytes(read_item, value)


def read_metadata(dcp_dir: str):
    """DCP's Metadata of `dcp_dir`, its pickle checked first; raises PickleRefused or what DCP raises."""
    return CheckedFileSystemReader(dcp_dir).read_metadata()
