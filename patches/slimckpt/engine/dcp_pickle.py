"""DCP's reader and load planner with pickle_policy in front of their unpickling.

torch.distributed.checkpoint unpickles two things with plain pickle: `dcp/.metadata`
(FileSystemReader.read_metadata: `pickle.load`) and every non-tensor record of the `.distcp`
files (DefaultLoadPlanner.load_bytes: `torch.load(weights_only=False)`: the optimizer's
param_groups and other Python values). Its tensor records it reads with `weights_only=True`
already. Here both are unpickled by pickle_policy's RestrictedUnpickler instead: `.metadata`
directly (what FileSystemReader does after its `pickle.load` is kept), a byte record by the one
`.pt` reader (`pt_tensors.load_bytes`), its value then set where DCP's planner sets it. A
booby-trapped step is refused (PickleRefused, naming the file and the global) before any of it runs.

The tensor records are read through a memory map of their file instead of DCP's `torch.load` of
the record: DCP builds the whole saved chunk (a rank's whole shard of the largest parameter, 0.75 GiB
for a 3.6B Llama's embedding at two ranks) in anonymous memory before it copies the part it wants,
while the mapped record is file pages the kernel can drop. The record's pickle is read by pt_index
(pickle_policy's globals only); a record it does not recognise as one plain tensor goes to DCP's way.
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import os
from collections.abc import Iterator

from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.filesystem import FileSystem
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, StorageMeta
from torch.distributed.checkpoint.planner import LoadItemType
from torch.futures import Future

from slimckpt.engine import pt_index, pt_tensors
from slimckpt.engine.pickle_policy import PickleRefused, RestrictedUnpickler, read_all
from slimckpt.storage import for_path, is_url

METADATA_NAME = ".metadata"


def _narrow(tensor, offsets, lengths):
    """The part of a saved chunk a read item asks for (DCP's narrow_tensor_by_index)."""
    for dim, (start, length) in enumerate(zip(offsets, lengths)):
        if start != 0 or length != tensor.size(dim):
            tensor = tensor.narrow(dim, start, length)
    return tensor


class StorageFileSystem(FileSystem):
    """torch's FileSystem for reading, with a URL read through its storage (ranged reads of an object)
    and kept a string (torch's would make it a Path and fold its "//")."""

    @contextlib.contextmanager
    def create_stream(self, path: str | os.PathLike, mode: str) -> Iterator[io.IOBase]:
        if not is_url(str(path)):
            with super().create_stream(path, mode) as stream:
                yield stream
            return
        if mode != "rb":
            raise ValueError(f"{path}: a checkpoint is only read here, not opened with mode {mode!r}")
        with for_path(str(path)).open_read(str(path)) as stream:
            yield stream

    def init_path(self, path: str | os.PathLike) -> str | os.PathLike:
        return str(path) if is_url(str(path)) else super().init_path(path)

    def concat_path(self, path: str | os.PathLike, suffix: str) -> str | os.PathLike:
        return f"{str(path).rstrip('/')}/{suffix}" if is_url(str(path)) else super().concat_path(path, suffix)


class CheckedFileSystemReader(FileSystemReader):
    """FileSystemReader whose `.metadata` is unpickled with pickle_policy's globals only, and whose
    tensor records are copied from a memory map of their file. A step on object storage (a URL) is
    read through its storage: each record's bytes by a ranged read, DCP's own way (no map)."""

    def __init__(self, path: str | os.PathLike, *args, **kwargs) -> None:
        super().__init__(path, *args, **kwargs)
        self.fs = StorageFileSystem()
        self.path = self.fs.init_path(path)

    def read_metadata(self, *args, **kwargs):
        path = os.path.join(os.fspath(self.path), METADATA_NAME)
        with self.fs.create_stream(path, "rb") as f:
            unpickler = RestrictedUnpickler(f)
            unpickler.path = path
            metadata = unpickler.load()
        if getattr(metadata, "storage_meta", None) is None:  # as FileSystemReader.read_metadata does
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata

    def read_data(self, plan, planner):
        maps: dict[str, object] = {}
        rest = [
            req for req in plan.items if req.type == LoadItemType.BYTE_IO or not self._read_mapped(req, planner, maps)
        ]
        maps.clear()  # each map closes with the last tensor viewing it
        if rest:
            return super().read_data(dataclasses.replace(plan, items=rest), planner)
        done: Future = Future()
        done.set_result(None)
        return done

    def _read_mapped(self, req, planner, maps: dict) -> bool:
        """Copy one tensor read item from the mapped record; False where DCP's own way must read it."""
        info = self.storage_data[req.storage_index]
        if getattr(info, "transform_descriptors", None) or is_url(os.fspath(self.path)):
            return False
        path = os.fspath(self.fs.concat_path(self.path, info.relative_path))
        try:
            record = pt_index.PtFile(path, base=info.offset, length=info.length).state
        except pt_index.NotATorchFile:
            return False
        if not isinstance(record, pt_index.TensorRecord):
            return False
        if path not in maps:
            maps[path] = pt_tensors.mapping(path, pt_tensors.READ)
        saved = _narrow(pt_tensors.record_tensor(maps[path], record), req.storage_offsets, req.lengths)
        target = planner.resolve_tensor(req).detach()
        if target.size() != saved.size():
            raise AssertionError(f"req {req.storage_index} mismatch sizes {target.size()} vs {saved.size()}")
        target.copy_(saved)
        planner.commit_tensor(req, target)
        return True


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
    if not is_url(dcp_dir):
        return CheckedFileSystemReader(dcp_dir).read_metadata()
    path = f"{dcp_dir.rstrip('/')}/{METADATA_NAME}"  # a remote step's: read whole (it is small), same unpickler
    with for_path(path).open_read(path) as f:
        data = read_all(f)
    unpickler = RestrictedUnpickler(io.BytesIO(data))
    unpickler.path = path
    metadata = unpickler.load()
    if getattr(metadata, "storage_meta", None) is None:
        metadata.storage_meta = StorageMeta()
    return metadata


def byte_record_keys(metadata) -> set[str]:
    """The keys of a step DCP saved as pickled bytes (not tensors): what a load unpickles."""
    return {k for k, m in metadata.state_dict_metadata.items() if isinstance(m, BytesStorageMetadata)}
