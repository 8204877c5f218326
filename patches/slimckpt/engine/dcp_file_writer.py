"""DCP's FileSystemWriter, holding at most one tensor per writer thread in host memory.

torch's per-file loop (`torch.distributed.checkpoint.filesystem._write_files_from_queue`, in
the releases slimckpt.internals lists; on others FileSystemWriter's own loop writes) keeps every tensor of a file in a dict until the file is finished (it needs them only for the
safetensors format). The incremental tier writes one file per rank and thread
(`single_file_per_rank=True`), so on GPU every host copy of the rank's shards, model and
optimizer, stays alive until the rank's file is done: the whole shard in host RAM, the copy this
tier exists to avoid. On CPU the loop's minimal-storage clones (DCP clones a tensor whose storage
is larger than its data, e.g. a padded FSDP shard) pile up the same way.

`BoundedFileSystemWriter` writes the same items, in the same order, with torch's own per-item
serializer (`_write_item`), into the same files, and drops each tensor once it is written. The
files are byte for byte what FileSystemWriter writes (tests/engine/test_dcp_file_writer.py).
What it gives up: torch's copy-ahead of device tensors (`per_thread_copy_ahead`, used with one
thread on CUDA): each device-to-host copy here finishes before its write starts.
"""

from __future__ import annotations

import io
import os
import queue
import threading
from typing import Any

import torch
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.filesystem import SerializationFormat
from torch.distributed.checkpoint.planner import WriteItemType
from torch.futures import Future

from slimckpt import internals
from slimckpt.log import get_logger
from slimckpt.storage import for_path

log = get_logger("slimckpt.resume")


def _bounded_write_item():
    """torch's per-item serializer where this torch's writer loop was checked (the file format stays
    torch's own), else None: FileSystemWriter's own loop then writes."""
    write_item = internals.lookup("torch.distributed.checkpoint.filesystem:_write_item")
    replaced = internals.lookup("torch.distributed.checkpoint.filesystem:FileSystemWriter._write_data")
    return write_item if write_item is not None and replaced is not None else None


def host_tensor(data: torch.Tensor) -> torch.Tensor:
    """What torch.save should serialize for one write item: on the host, and with no more storage
    than its own bytes (torch.save writes a tensor's whole storage)."""
    tensor = data.detach().cpu()
    if tensor.untyped_storage().size() != tensor.numel() * tensor.element_size():
        tensor = tensor.clone()
    return tensor


class BoundedFileSystemWriter(FileSystemWriter):
    """FileSystemWriter whose writer threads each hold one tensor at a time (see the module doc)."""

    def _write_data(self, planner, file_queue: queue.Queue) -> Future:
        write_item = _bounded_write_item()
        if write_item is None:
            return super()._write_data(planner, file_queue)

        if self.serialization_format != SerializationFormat.TORCH_SAVE:
            if not getattr(BoundedFileSystemWriter, "_warned", False):
                BoundedFileSystemWriter._warned = True
                log.warning(
                    "slimckpt: DCP's safetensors format cannot be written bounded: each rank file keeps "
                    "its tensors in host memory until it is written"
                )
            return super()._write_data(planner, file_queue)
        results: queue.Queue = queue.Queue()
        errors: list[BaseException] = []

        def work() -> None:
            try:
                while True:
                    try:
                        path, storage_key, items = file_queue.get_nowait()
                    except queue.Empty:
                        return
                    results.put(self._write_file(planner, path, storage_key, items, write_item))
            except BaseException as exc:  # noqa: BLE001 - raised on the calling thread below
                errors.append(exc)

        threads = [
            threading.Thread(target=work, name=f"slimckpt-dcp-write-{i}", daemon=True)
            for i in range(1, self.thread_count)
        ]
        for t in threads:
            t.start()
        work()
        for t in threads:
            t.join()
        if errors:
            raise errors[0]
        written: list = []
        while not results.empty():
            written += results.get_nowait()
        future: Future = Future()
        future.set_result(written)
        return future

    def _write_file(self, planner, path: Any, storage_key: str, items: list, write_item: Any) -> list:
        """One rank file: its byte items, then its tensors in the order FileSystemWriter writes
        them; each tensor is released before the next one is read."""
        written = []
        with self.fs.create_stream(path, "wb") as stream:
            for item in [i for i in items if i.type == WriteItemType.BYTE_IO]:
                written.append(
                    write_item(
                        self.transforms,
                        stream,
                        planner.resolve_data(item),
                        item,
                        storage_key,
                        self.serialization_format,
                    )
                )
            for item in [i for i in items if i.type != WriteItemType.BYTE_IO]:
                tensor = host_tensor(planner.resolve_data(item))
                written.append(
                    write_item(self.transforms, stream, tensor, item, storage_key, self.serialization_format)
                )
                del tensor
            if self.sync_files:
                try:
                    for_path(str(path)).sync_open(stream)
                except (AttributeError, io.UnsupportedOperation):
                    os.sync()
        return written
