"""slimckpt's DCP writer (write.dcp_file_writer) writes the files torch's FileSystemWriter writes,
byte for byte, and holds one tensor at a time where torch's holds every tensor of a rank file
until the file is done (the whole shard on GPU; on CPU, the clones of padded shards)."""

from __future__ import annotations

import gc
import os

import pytest
import torch

from slimckpt.observe.memory import RssSampler
from slimckpt.save.step_write import storage_writer

MIB = 2**20


class _Config:
    def __init__(self, threads: int) -> None:
        self.write_threads, self.bucket_mb = threads, 1


def _padded_views(n: int, numel: int) -> dict[str, torch.Tensor]:
    """Tensors whose storage is twice their data, as a padded FSDP shard's: DCP clones each."""
    g = torch.Generator().manual_seed(0)
    return {f"w{i}": torch.randn(2 * numel, generator=g)[:numel] for i in range(n)}


def _dcp_files(path) -> dict[str, bytes]:
    return {n: open(os.path.join(path, n), "rb").read() for n in sorted(os.listdir(path)) if n.endswith(".distcp")}


@pytest.mark.parametrize("threads", [1, 2])
def test_files_are_torchs_byte_for_byte_and_load_back(tmp_path, threads):
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemWriter

    state = {"model": _padded_views(4, 1000), "optimizer": {"step": 3, "note": "bytes too", "m": torch.arange(7.0)}}
    ours = storage_writer(str(tmp_path / "ours"), _Config(threads))
    dcp.save(state, storage_writer=ours, no_dist=True)
    theirs = FileSystemWriter(
        str(tmp_path / "torch"), single_file_per_rank=True, sync_files=True, thread_count=threads, overwrite=True
    )
    dcp.save(state, storage_writer=theirs, no_dist=True)
    files = _dcp_files(tmp_path / "ours")
    assert files and files == _dcp_files(tmp_path / "torch")
    back = {
        "model": {k: torch.zeros_like(v) for k, v in state["model"].items()},
        "optimizer": {"step": 0, "note": "", "m": torch.zeros(7)},
    }
    dcp.load(back, checkpoint_id=str(tmp_path / "ours"), no_dist=True)
    assert all(torch.equal(back["model"][k], v) for k, v in state["model"].items())
    assert back["optimizer"]["step"] == 3 and torch.equal(back["optimizer"]["m"], state["optimizer"]["m"])


def _extra_during_save(writer, state) -> int:
    import torch.distributed.checkpoint as dcp

    gc.collect()
    with RssSampler(interval_s=0.002) as sampler:
        dcp.save(state, storage_writer=writer, no_dist=True)
    return sampler.result.extra


@pytest.mark.slow
def test_one_tensor_at_a_time_where_torch_holds_the_file(tmp_path):
    """8 padded shards of 32 MiB: torch's writer holds all 8 clones until the rank file ends; ours
    one (plus the sampler's slack). The torch figure shows the scenario has something to catch."""
    from torch.distributed.checkpoint import FileSystemWriter

    item = 32 * MIB
    state = {"model": _padded_views(8, item // 4)}
    ours = _extra_during_save(storage_writer(str(tmp_path / "ours"), _Config(1)), state)
    theirs = _extra_during_save(
        FileSystemWriter(str(tmp_path / "torch"), single_file_per_rank=True, thread_count=1, overwrite=True), state
    )
    assert theirs > 5 * item, f"torch's writer held only {theirs / MIB:.0f} MiB: the scenario catches nothing"
    assert ours <= 2 * item + 16 * MIB, f"ours held {ours / MIB:.0f} MiB (torch's: {theirs / MIB:.0f} MiB)"


def test_a_failing_writer_thread_fails_the_save(tmp_path, monkeypatch):
    """torch's extra writer threads die silently on an error; ours raise it on the calling thread.
    The main thread waits in its first tensor until the second thread has failed in its own file."""
    import threading

    import torch.distributed.checkpoint as dcp

    from slimckpt.engine import dcp_file_writer

    real, failed = dcp_file_writer.host_tensor, threading.Event()

    def broken(data):
        if threading.current_thread() is threading.main_thread():
            # the second writer thread starts in milliseconds; 30 s is a hang
            assert failed.wait(timeout=30), "the second writer thread never started"
            return real(data)
        failed.set()
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(dcp_file_writer, "host_tensor", broken)
    with pytest.raises(BaseException) as info:  # DCP's CheckpointException is a BaseException
        dcp.save(
            {"model": _padded_views(4, 1000)},
            storage_writer=storage_writer(str(tmp_path / "d"), _Config(2)),
            no_dist=True,
        )
    assert "No space left on device" in str(info.value)
