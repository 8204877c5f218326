"""Checksums computed while DCP writes its files (slimckpt.engine.hashing_fs) equal the checksums of
the files read back, for every file DCP wrote, with one and with two writer threads."""

from __future__ import annotations

import os

import pytest
import torch

from slimckpt.layout.merge_manifest import DEFAULT_ALGO, file_checksum
from slimckpt.save.step_write import storage_writer, written_checksums


class _Config:
    def __init__(self, threads: int) -> None:
        self.write_threads, self.bucket_mb = threads, 1


@pytest.mark.parametrize("threads", [1, 2])
def test_checksums_while_writing_equal_read_back(tmp_path, threads):
    import torch.distributed.checkpoint as dcp

    g = torch.Generator().manual_seed(0)
    state = {
        "model": {f"w{i}": torch.randn(64, 33, generator=g) for i in range(5)},
        "optimizer": {"step": 3, "note": "bytes too", "m": torch.randn(7, generator=g)},
    }
    writer = storage_writer(str(tmp_path / "dcp"), _Config(threads))
    dcp.save(state, storage_writer=writer, no_dist=True)
    sums = written_checksums(writer, str(tmp_path))
    on_disk = sorted(f"dcp/{n}" for n in os.listdir(tmp_path / "dcp"))
    assert sorted(sums) == on_disk and any(n.endswith(".metadata") for n in sums)
    for rel, digest in sums.items():
        assert digest == file_checksum(str(tmp_path / rel), DEFAULT_ALGO), rel


def test_a_seeked_stream_is_left_to_the_read_back(tmp_path):
    from slimckpt.engine.hashing_fs import HashingFileSystem

    fs = HashingFileSystem()
    with fs.create_stream(tmp_path / "a", "wb") as s:
        s.write(b"hello")
        s.seek(0)
        s.write(b"J")
    with fs.create_stream(tmp_path / "b", "wb") as s:
        s.write(b"hello")
    assert list(fs.checksums) == [str(tmp_path / "b")]
