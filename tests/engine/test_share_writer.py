"""The merge's writer (slimckpt.engine.share_writer.ShareWriter) over real rank files: the bytes are the
tensors in the output dtype whatever the chunk size or the number of workers, and a chunk already in
the output dtype is written straight from the mapped rank file."""

from __future__ import annotations

import pytest
import torch

import slimckpt.layout.safetensors_layout as layout
from slimckpt.engine import out_files
from slimckpt.engine.out_files import create_files
from slimckpt.engine.share_writer import ShareWriter
from slimckpt.engine.verl_sources import SourceTensor


def _rank_files(tmp_path, full: torch.Tensor, world: int) -> SourceTensor:
    """A dim-0 sharded tensor whose pieces are memory-mapped from real rank files, as sources.py
    opens them."""
    pieces = []
    for r, chunk in enumerate(torch.chunk(full, world)):
        path = tmp_path / f"model_world_size_{world}_rank_{r}.pt"
        # a small tensor first, so the shard does not start on a block boundary of the file
        torch.save({"pad": torch.arange(3, dtype=torch.int8), "w": chunk.clone()}, path)
        pieces.append(torch.load(path, mmap=True)["w"])
    return SourceTensor(
        "w", tuple(full.shape), full.dtype, 0, pieces, list(range(world)), local_dir=str(tmp_path), world_size=world
    )


def _write(tmp_path, name: str, sources: dict[str, SourceTensor], chunk_bytes: int, workers: int = 1) -> bytes:
    root = tmp_path / name
    root.mkdir()
    specs = [layout.TensorSpec(n, "BF16", s.shape) for n, s in sources.items()]
    plan = layout.plan_files(specs, "5GB")
    create_files(str(root), plan)
    for share in layout.partition(plan, workers):
        ShareWriter(str(root), plan, sources, torch.bfloat16, chunk_bytes=chunk_bytes).write_share(share)
    (f,) = plan.files
    return (root / f.name).read_bytes()


def _sources(tmp_path, dtype: torch.dtype) -> dict[str, SourceTensor]:
    torch.manual_seed(0)
    out = {}
    for i, shape in enumerate([(37, 13), (1000, 129), (3, 5000)]):  # rows that leave offsets unaligned
        d = tmp_path / f"src{i}"
        d.mkdir()
        out[f"t{i}"] = _rank_files(d, torch.randn(*shape).to(dtype), 2 + i % 2)
        out[f"t{i}"].name = f"t{i}"
    return out


def _want(sources: dict[str, SourceTensor]) -> bytes:
    """bf16 of the full tensors, in the planned order."""
    return b"".join(
        torch.cat(s.pieces).to(torch.bfloat16).contiguous().view(torch.uint8).numpy().tobytes()
        for s in sources.values()
    )


@pytest.mark.parametrize("chunk_bytes", [4096, 3 * 4096 + 7, 1 << 20])
def test_the_bytes_are_the_tensors_whatever_the_chunks_and_workers(tmp_path, chunk_bytes):
    sources = _sources(tmp_path, torch.float32)
    one = _write(tmp_path, "one", sources, chunk_bytes)
    assert one == _write(tmp_path, "two", sources, chunk_bytes, workers=2)
    assert one.endswith(_want(sources))


def test_a_chunk_already_in_the_output_dtype_is_written_from_the_mapped_file(tmp_path, monkeypatch):
    """No staging copy for a bf16 checkpoint merged to bf16: the write reads the page cache's pages."""
    staged = []
    real_take = out_files.StagingRing.take
    monkeypatch.setattr(out_files.StagingRing, "take", lambda self, n: staged.append(n) or real_take(self, n))
    sources = _sources(tmp_path, torch.bfloat16)
    assert _write(tmp_path, "bf16", sources, 4096).endswith(_want(sources))
    assert staged == []
    (tmp_path / "fp32").mkdir()
    fp32 = _sources(tmp_path / "fp32", torch.float32)
    assert _write(tmp_path, "cast", fp32, 4096).endswith(_want(fp32))
    assert staged, "an fp32 source is cast into the staging buffers"
