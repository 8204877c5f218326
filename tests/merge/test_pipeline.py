"""The merge's write pipeline (slimckpt.engine.share_writer): casts overlapped with writes, a failed
write surfaced and the output discarded, in the words of merge/steps (its one-line message)."""

from __future__ import annotations

import errno
import os

import pytest
import torch

import slimckpt.layout.safetensors_layout as layout
import slimckpt.merge.pipeline as merge
from slimckpt.engine.out_files import OutputError, create_files
from slimckpt.engine.share_writer import ShareWriter
from slimckpt.engine.verl_sources import SourceTensor

from ..helpers.merge_helpers import full_disk_after_headers, synthetic_checkpoint


def _merge(local, target, **kw):
    return merge.merge(merge.MergeOptions(local_dir=str(local), target_dir=str(target), progress=False, **kw))


def test_a_failed_write_is_the_users_error_and_leaves_nothing(tmp_path, monkeypatch):
    ckpt = synthetic_checkpoint(tmp_path / "actor", world_size=2)
    full_disk_after_headers(monkeypatch)
    with pytest.raises(merge.MergeError, match=r"model.*safetensors.*(space|full)"):
        _merge(ckpt, tmp_path / "out")
    assert not (tmp_path / "out").exists() and not (tmp_path / "out.partial").exists()


def test_the_writer_records_where_its_time_went(tmp_path, monkeypatch):
    from slimckpt.engine.writer_stats import STATS_ENV, WriterStats

    ckpt = synthetic_checkpoint(tmp_path / "actor", world_size=2)
    monkeypatch.setenv(STATS_ENV, str(tmp_path / "stats.json"))
    _merge(ckpt, tmp_path / "out")
    stats = WriterStats.load(str(tmp_path / "stats.json"))
    assert stats.wall_s > 0 and 0 < stats.cast_s <= stats.wall_s and 0 <= stats.close_s <= stats.wall_s


def test_a_failed_background_write_surfaces_and_stops(tmp_path, monkeypatch):
    full = torch.randn(64, 32)
    src = SourceTensor("w", tuple(full.shape), full.dtype, 0, list(torch.chunk(full, 2)), [0, 1])
    plan = layout.plan_files([layout.TensorSpec("w", "BF16", tuple(full.shape))], "5GB")
    create_files(str(tmp_path), plan)
    calls = []

    def failing(fd, data, off):
        calls.append(len(data))
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "pwrite", failing)
    writer = ShareWriter(str(tmp_path), plan, {"w": src}, torch.bfloat16, chunk_bytes=256)
    with pytest.raises(OutputError, match="model.safetensors"):
        writer.write_share(layout.partition(plan, 1)[0])
    assert len(calls) == 1  # writes after the failed one are dropped, not attempted


@pytest.mark.parametrize("durable", [True, False])
def test_no_fsync_skips_only_the_weight_fsyncs(tmp_path, monkeypatch, durable):
    full = torch.randn(16, 8)
    src = SourceTensor("w", tuple(full.shape), full.dtype, 0, list(torch.chunk(full, 2)), [0, 1])
    plan = layout.plan_files([layout.TensorSpec("w", "BF16", tuple(full.shape))], "5GB")
    create_files(str(tmp_path), plan)
    synced = []
    real = os.fsync
    monkeypatch.setattr(os, "fsync", lambda fd: synced.append(fd) or real(fd))
    writer = ShareWriter(str(tmp_path), plan, {"w": src}, torch.bfloat16, fsync=durable)
    writer.write_share(layout.partition(plan, 1)[0])
    assert bool(synced) == durable
    assert "model.safetensors" in writer.checksums  # the manifest's checksums are there either way
