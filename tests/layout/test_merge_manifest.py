"""slimckpt.layout.merge_manifest (commit, verify) and slimckpt.engine.share_writer (chunked positional writes), without torchrun."""

from __future__ import annotations

import os

import pytest
import torch
from safetensors.torch import load_file

import slimckpt.layout.merge_manifest as manifest
import slimckpt.layout.safetensors_layout as layout
from slimckpt.engine import output_dir
from slimckpt.engine.out_files import create_files
from slimckpt.engine.output_dir import commit, write_manifest
from slimckpt.engine.share_writer import ShareWriter
from slimckpt.engine.verl_sources import TORCH_TO_SAFETENSORS, CheckpointError, SourceTensor
from slimckpt.layout.merge_manifest import (
    CommitError,
    Manifest,
    build_entries,
    check_target,
    verify,
)


def committed_dir(tmp_path):
    partial = output_dir.prepare_partial(str(tmp_path / "out"))
    for name, data in {"a.bin": b"x" * 1000, "sub/b.json": b"{}"}.items():
        os.makedirs(os.path.dirname(os.path.join(partial, name)), exist_ok=True)
        with open(os.path.join(partial, name), "wb") as f:
            f.write(data)
    write_manifest(partial, Manifest(kind="test", files=build_entries(partial), tool_version="t"))
    commit(partial, str(tmp_path / "out"))
    return tmp_path / "out"


def test_commit_and_verify(tmp_path):
    out = committed_dir(tmp_path)
    assert not (tmp_path / "out.partial").exists()
    assert verify(str(out)) == []
    m = manifest.read_manifest(str(out))
    assert set(m.files) == {"a.bin", "sub/b.json"} and m.files["a.bin"].size == 1000
    assert Manifest.from_json(m.to_bytes().decode()) == m


@pytest.mark.parametrize(
    "damage,reason",
    [("flip", "manifest says"), ("truncate", "size 999"), ("remove", "missing"), ("extra", "not in the manifest")],
)
def test_verify_reports_bad_files(tmp_path, damage, reason):
    out = committed_dir(tmp_path)
    path = out / "a.bin"
    if damage == "flip":
        path.write_bytes(b"y" + b"x" * 999)
    elif damage == "truncate":
        path.write_bytes(b"x" * 999)
    elif damage == "remove":
        path.unlink()
    else:
        (out / "stray.txt").write_text("hi")
    bad = verify(str(out))
    assert len(bad) == 1 and reason in bad[0].reason
    assert bad[0].name == ("stray.txt" if damage == "extra" else "a.bin")


def test_verify_without_manifest(tmp_path):
    (tmp_path / "x").mkdir()
    assert [b.name for b in verify(str(tmp_path / "x"))] == [manifest.MANIFEST_NAME]
    (tmp_path / "x" / manifest.MANIFEST_NAME).write_text("{not json")
    assert "unreadable" in verify(str(tmp_path / "x"))[0].reason


def test_check_target_rules(tmp_path):
    check_target(str(tmp_path / "new"), overwrite=False)
    (tmp_path / "empty").mkdir()
    check_target(str(tmp_path / "empty"), overwrite=False)
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "f").write_text("x")
    with pytest.raises(CommitError, match="not empty; pass --overwrite"):
        check_target(str(tmp_path / "full"), overwrite=False)
    check_target(str(tmp_path / "full"), overwrite=True)
    (tmp_path / "file").write_text("x")
    with pytest.raises(CommitError, match="not a directory"):
        check_target(str(tmp_path / "file"), overwrite=True)
    with pytest.raises(CommitError, match="does not exist"):
        check_target(str(tmp_path / "no" / "such" / "dir"), overwrite=False)


def test_commit_refuses_a_target_filled_meanwhile(tmp_path):
    partial = output_dir.prepare_partial(str(tmp_path / "out"))
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "other").write_text("someone else's")
    with pytest.raises(CommitError, match="became non-empty"):
        commit(partial, str(tmp_path / "out"))
    assert (tmp_path / "out" / "other").exists() and os.path.isdir(partial)


# -- writer ------------------------------------------------------------------------------------------
def _plan_and_sources(tensors: dict[str, SourceTensor], out_dtype: torch.dtype):
    st = TORCH_TO_SAFETENSORS[out_dtype]
    specs = [layout.TensorSpec(n, st, s.shape) for n, s in tensors.items()]
    return layout.plan_files(specs, "5GB")


def _sharded(name, full: torch.Tensor, dim: int, n: int) -> SourceTensor:
    pieces = list(torch.chunk(full, n, dim=dim))
    return SourceTensor(name, tuple(full.shape), full.dtype, dim, pieces, list(range(len(pieces))))


@pytest.mark.parametrize("chunk_bytes", [1, 100, 64 << 20])
@pytest.mark.parametrize("n_workers", [1, 3])
def test_writer_chunks_and_shares(tmp_path, chunk_bytes, n_workers):
    g = torch.Generator().manual_seed(0)
    full = {
        "w": torch.randn(37, 11, generator=g),
        "v": torch.randn(10, 4, 3, generator=g),
        "c": torch.randn(6, 9, generator=g),
        "s": torch.tensor(3.5),
        "i": torch.arange(7),
        "e": torch.zeros(0, 5),
    }
    sources = {
        "w": _sharded("w", full["w"], 0, 3),  # uneven: 13, 13, 11
        "v": _sharded("v", full["v"], 1, 2),  # Shard(1)
        "c": _sharded("c", full["c"], 1, 3),
        "s": SourceTensor("s", (), torch.float32, None, [full["s"], full["s"].clone()], [0, 1]),
        "i": SourceTensor("i", (7,), torch.int64, None, [full["i"]], [0]),
        "e": _sharded("e", full["e"], 0, 2),
    }
    plan = _plan_and_sources(sources, torch.bfloat16)
    root = str(tmp_path)
    create_files(root, plan)
    checksums = {}
    for share in layout.partition(plan, n_workers):
        w = ShareWriter(root, plan, sources, torch.bfloat16, chunk_bytes=chunk_bytes)
        w.write_share(share)
        checksums.update(w.checksums)
    out = load_file(str(tmp_path / "model.safetensors"))
    for name, t in full.items():
        assert torch.equal(out[name], t.to(torch.bfloat16)), name
    expected = manifest.file_checksum(str(tmp_path / "model.safetensors"))
    if n_workers == 1:
        assert checksums == {"model.safetensors": expected}  # computed while writing, no read-back
    else:
        assert checksums.get("model.safetensors", expected) == expected


def test_writer_detects_diverging_copies(tmp_path):
    a = torch.ones(4)
    sources = {"n": SourceTensor("n", (4,), torch.float32, None, [a, a + 1], [0, 3])}
    plan = _plan_and_sources(sources, torch.bfloat16)
    create_files(str(tmp_path), plan)
    with pytest.raises(CheckpointError, match="rank_3.pt: unsharded entry 'n' differs"):
        ShareWriter(str(tmp_path), plan, sources, torch.bfloat16).write_share(layout.partition(plan, 1)[0])


def test_writer_bounded_chunks(tmp_path, monkeypatch):
    """No single cast/write is larger than the chunk (here 4 KiB of a 400 KiB tensor)."""
    full = torch.randn(400, 256)
    sources = {"w": _sharded("w", full, 0, 2)}
    plan = _plan_and_sources(sources, torch.bfloat16)
    create_files(str(tmp_path), plan)
    sizes = []
    real = os.pwrite
    monkeypatch.setattr(os, "pwrite", lambda fd, data, off: sizes.append(len(data)) or real(fd, data, off))
    ShareWriter(str(tmp_path), plan, sources, torch.bfloat16, chunk_bytes=4096).write_share(
        layout.partition(plan, 1)[0]
    )
    assert max(sizes) <= 4096 and sum(sizes) == 400 * 256 * 2
