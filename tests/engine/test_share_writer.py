"""The merge's writer (slimckpt.engine.share_writer.ShareWriter) over real rank files: the bytes are the
tensors in the output dtype whatever the chunk size, the number of workers and the path to the disk
(whole blocks around the page cache, the ends through it); a chunk already in the output dtype is
written straight from the mapped rank file through the page cache; chunked positional writes shared
by workers, diverging copies refused, chunks bounded."""

from __future__ import annotations

import os

import pytest
import torch
from safetensors.torch import load_file

import slimckpt.layout.merge_manifest as manifest
import slimckpt.layout.safetensors_layout as layout
from slimckpt.engine import out_files
from slimckpt.engine.out_files import create_files
from slimckpt.engine.share_writer import ShareWriter
from slimckpt.engine.verl_sources import TORCH_TO_SAFETENSORS, CheckpointError, SourceTensor
from slimckpt.storage import posix
from slimckpt.storage.base import DIRECT_ALIGN


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


def _write(
    tmp_path, name: str, sources: dict[str, SourceTensor], chunk_bytes: int, workers: int = 1, direct: bool = True
) -> bytes:
    root = tmp_path / name
    root.mkdir()
    specs = [layout.TensorSpec(n, "BF16", s.shape) for n, s in sources.items()]
    plan = layout.plan_files(specs, "5GB")
    create_files(str(root), plan)
    for share in layout.partition(plan, workers):
        ShareWriter(str(root), plan, sources, torch.bfloat16, chunk_bytes=chunk_bytes, direct=direct).write_share(share)
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
    assert one == _write(tmp_path, "three", sources, chunk_bytes, workers=3)
    assert one == _write(tmp_path, "cached", sources, chunk_bytes, direct=False)
    assert one.endswith(_want(sources))


def test_whole_blocks_go_around_the_page_cache_and_the_ends_through_it(tmp_path, monkeypatch):
    """Writes at unaligned offsets: the aligned middle of each chunk through the O_DIRECT descriptor,
    the bytes before and after it through the page cache, and the file equal to the tensors."""
    if not _probe_direct(tmp_path):
        pytest.skip("this filesystem refuses O_DIRECT")
    sent = {"direct": 0, "cached": 0}
    real = posix.pwrite_all

    def counting(fd, data, offset):
        kind = "direct" if fd in direct_fds else "cached"
        sent[kind] += len(memoryview(data))
        if kind == "direct":
            assert offset % DIRECT_ALIGN == 0 and len(memoryview(data)) % DIRECT_ALIGN == 0
        real(fd, data, offset)

    direct_fds: set[int] = set()
    real_open = posix.open_direct
    monkeypatch.setattr(posix, "open_direct", lambda path: _remember(real_open(path), direct_fds))
    monkeypatch.setattr(posix, "pwrite_all", counting)
    sources = _sources(tmp_path, torch.float32)
    data = _write(tmp_path, "out", sources, 1 << 20, workers=2)
    assert data.endswith(_want(sources))
    assert direct_fds and sent["direct"] > 0.9 * len(_want(sources)), sent


def _probe_direct(tmp_path) -> bool:
    (tmp_path / "probe").write_bytes(b"")
    fd = posix.open_direct(str(tmp_path / "probe"))
    if fd is None:
        return False
    os.close(fd)
    return True


def _remember(fd, fds: set[int]):
    if fd is not None:
        fds.add(fd)
    return fd


@pytest.mark.parametrize("direct", [False, True])
def test_a_chunk_already_in_the_output_dtype_is_staged_only_to_go_around_the_page_cache(tmp_path, monkeypatch, direct):
    """A bf16 checkpoint merged to bf16: through the page cache, no staging copy (the write reads
    the page cache's pages); around it, each chunk is copied to an aligned staging buffer first
    (a buffered write copies it too, into the page cache)."""
    staged = []
    real_take = out_files.StagingRing.take
    monkeypatch.setattr(out_files.StagingRing, "take", lambda self, n: staged.append(n) or real_take(self, n))
    sources = _sources(tmp_path, torch.bfloat16)
    assert _write(tmp_path, "bf16", sources, 4096, direct=direct).endswith(_want(sources))
    assert bool(staged) == direct
    (tmp_path / "fp32").mkdir()
    fp32 = _sources(tmp_path / "fp32", torch.float32)
    assert _write(tmp_path, "cast", fp32, 4096, direct=direct).endswith(_want(fp32))
    assert staged, "an fp32 source is cast into the staging buffers"


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
