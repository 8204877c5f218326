"""O_DIRECT in the merge (slimckpt.read.direct_io, slimckpt.read.direct_read, writer.ShareWriter): the split of
a write into buffered ends and a direct middle, reads of shard rows straight from rank files, and
the same output bytes whether the disk path is direct, refused by the filesystem, or switched off."""

from __future__ import annotations

import errno
import os

import pytest
import torch

from slimckpt.format import layout
from slimckpt.read import direct_io, direct_read
from slimckpt.read.sources import CheckpointError, SourceTensor
from slimckpt.write.out_files import create_files
from slimckpt.write.share_writer import ShareWriter

from ..helpers.slim_logs import lines_of

A = direct_io.ALIGN


@pytest.mark.parametrize(
    "offset,length,address,expect",
    [
        (0, 3 * A, 0, (0, 3 * A, 0)),  # all aligned
        (10, 3 * A, 10, (A - 10, 2 * A, 10)),  # congruent: partial block at each end
        (10, 3 * A, 11, (3 * A, 0, 0)),  # not congruent: all buffered
        (A - 1, 2, A - 1, (1, 0, 1)),  # straddles one boundary, no whole block
        (5, 100, 5, (100, 0, 0)),  # inside one block
        (A, A - 1, 0, (0, 0, A - 1)),
        (7, 0, 7, (0, 0, 0)),
    ],
)
def test_split_keeps_direct_blocks_whole_and_aligned(offset, length, address, expect):
    head, body, tail = direct_io.split(offset, length, address)
    assert (head, body, tail) == expect
    assert head + body + tail == length
    if body:
        assert (offset + head) % A == 0 and (address + head) % A == 0 and body % A == 0


def test_aligned_empty_is_aligned():
    for n in (1, A, 3 * A + 5):
        t = direct_io.aligned_empty(n)
        assert t.data_ptr() % A == 0 and t.numel() == n


def _rank_files(tmp_path, full: torch.Tensor, world: int) -> SourceTensor:
    """A dim-0 sharded tensor whose pieces are memory-mapped from real rank files, as sources.py
    opens them (torch.load(mmap=True))."""
    pieces = []
    for r, chunk in enumerate(torch.chunk(full, world)):
        path = tmp_path / f"model_world_size_{world}_rank_{r}.pt"
        # a small tensor first, so the shard does not start on a block boundary of the file
        torch.save({"pad": torch.arange(3, dtype=torch.int8), "w": chunk.clone()}, path)
        pieces.append(torch.load(path, mmap=True)["w"])
    return SourceTensor(
        "w", tuple(full.shape), full.dtype, 0, pieces, list(range(world)), local_dir=str(tmp_path), world_size=world
    )


def test_prefetcher_reads_the_same_rows_as_the_mmap(tmp_path):
    src = _rank_files(tmp_path, torch.randn(301, 77), 2)
    paths = [src.file_of(k) for k in range(2)]
    files = direct_read.MappedFiles(paths)
    wanted = [(k, a, b) for k in range(2) for a, b in ((0, 1), (3, 40), (17, 150), (0, src.pieces[k].shape[0]))]
    reads = [direct_read.rows_read(files, src.pieces[k], a, b) for k, a, b in wanted]
    assert all(reads) and {r.path for r in reads} == set(paths)
    reads.insert(2, None)  # a chunk the caller serves from the mmap
    pf = direct_read.Prefetcher(reads)
    try:
        for i, r in enumerate(reads):
            if r is None:
                assert not pf.has(i)
                continue
            k, a, b = wanted[i if i < 2 else i - 1]
            want = src.pieces[k][a:b]
            assert torch.equal(torch.frombuffer(pf.get(i), dtype=torch.uint8).view(want.dtype).view(want.shape), want)
    finally:
        pf.close()


def test_prefetcher_names_a_truncated_file(tmp_path):
    src = _rank_files(tmp_path, torch.randn(64, 1024), 1)
    files = direct_read.MappedFiles([src.file_of(0)])
    read = direct_read.rows_read(files, src.pieces[0], 0, 64)
    os.truncate(src.file_of(0), read.offset + 100)
    pf = direct_read.Prefetcher([read])
    try:
        with pytest.raises(CheckpointError, match=r"model_world_size_1_rank_0\.pt: ends at byte .* truncated"):
            pf.get(0)
    finally:
        pf.close()


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


@pytest.fixture
def odd_sources(tmp_path):
    torch.manual_seed(0)
    out = {}
    for i, shape in enumerate([(37, 13), (1000, 129), (3, 5000)]):  # rows that leave offsets unaligned
        d = tmp_path / f"src{i}"
        d.mkdir()
        out[f"t{i}"] = _rank_files(d, torch.randn(*shape), 2 + i % 2)
        out[f"t{i}"].name = f"t{i}"
    return out


def _direct_fds(monkeypatch) -> set:
    """The O_DIRECT descriptors open right now (kept up to date: fd numbers get reused)."""
    opened: set = set()
    real_open_direct, real_close = direct_io.open_direct, os.close

    def open_direct(path, flags):
        fd = real_open_direct(path, flags)
        opened.add(fd)
        return fd

    monkeypatch.setattr(direct_io, "open_direct", open_direct)
    monkeypatch.setattr(os, "close", lambda fd: opened.discard(fd) or real_close(fd))
    return opened


@pytest.mark.parametrize("chunk_bytes", [A, 3 * A + 7, 1 << 20])
def test_direct_and_buffered_merges_write_the_same_bytes(tmp_path, monkeypatch, odd_sources, chunk_bytes):
    direct_bodies, preads = [], []
    real_pwrite, real_preadv = os.pwrite, os.preadv
    opened = _direct_fds(monkeypatch)
    monkeypatch.setattr(
        os,
        "pwrite",
        lambda fd, data, off: (direct_bodies.append(len(data)) if fd in opened else None) or real_pwrite(fd, data, off),
    )
    monkeypatch.setattr(os, "preadv", lambda fd, bufs, off: preads.append(fd) or real_preadv(fd, bufs, off))
    direct = _write(tmp_path, "direct", odd_sources, chunk_bytes)
    assert direct_bodies and all(n % A == 0 for n in direct_bodies), "nothing went through O_DIRECT"
    assert preads, "the rows were not read ahead"
    two_workers = _write(tmp_path, "direct2", odd_sources, chunk_bytes, workers=2)
    monkeypatch.setenv(direct_io.ENV, "0")
    direct_bodies.clear()
    buffered = _write(tmp_path, "buffered", odd_sources, chunk_bytes)
    assert not direct_bodies
    assert direct == buffered == two_workers
    # and the bytes are the tensors: bf16 of the full tensors in the planned order
    want = b"".join(
        torch.cat(s.pieces).to(torch.bfloat16).contiguous().view(torch.uint8).numpy().tobytes()
        for s in odd_sources.values()
    )
    assert direct.endswith(want)


def test_a_filesystem_refusing_o_direct_gets_the_same_bytes(tmp_path, monkeypatch, odd_sources):
    want = _write(tmp_path, "direct", odd_sources, 64 << 10)
    monkeypatch.setattr(direct_io, "open_direct", lambda path, flags: None)  # as tmpfs on older kernels
    assert _write(tmp_path, "refused_at_open", odd_sources, 64 << 10) == want
    monkeypatch.undo()

    opened = _direct_fds(monkeypatch)
    real_pwrite = os.pwrite
    refusals = []

    def stricter(fd, data, off):
        if fd in opened:
            refusals.append(fd)
            raise OSError(errno.EINVAL, "Invalid argument")  # alignment rules stricter than ALIGN
        return real_pwrite(fd, data, off)

    monkeypatch.setattr(os, "pwrite", stricter)
    assert _write(tmp_path, "refused_at_write", odd_sources, 64 << 10) == want
    assert len(refusals) == 1  # the first refusal switches that file to buffered writes


def _refuse_o_direct_at_open(monkeypatch) -> None:
    real_open = os.open

    def no_direct(path, flags, *args, **kwargs):
        if flags & os.O_DIRECT:
            raise OSError(errno.EINVAL, "Invalid argument")  # as tmpfs on older kernels, some network filesystems
        return real_open(path, flags, *args, **kwargs)

    monkeypatch.setattr(os, "open", no_direct)


def test_falling_back_to_the_page_cache_is_logged_once(tmp_path, monkeypatch, odd_sources):
    """The fallback was once silent, and slower (measured: BENCHMARKS.md, Figures quoted in the code)."""
    want = _write(tmp_path, "direct", odd_sources, 64 << 10)
    monkeypatch.setattr(direct_io, "_fallback_logged", False)
    _refuse_o_direct_at_open(monkeypatch)
    with lines_of(direct_io.log, "WARNING") as out:
        assert _write(tmp_path, "refused", odd_sources, 64 << 10) == want
        assert _write(tmp_path, "refused_again", odd_sources, 64 << 10) == want
    lines = out.getvalue().splitlines()
    assert len(lines) == 1, lines  # once per process, not once per file
    assert str(tmp_path) in lines[0] and "page cache" in lines[0] and f"{direct_io.ENV}=0" in lines[0], lines[0]


def test_a_refusal_mid_write_is_logged_too(tmp_path, monkeypatch, odd_sources):
    monkeypatch.setattr(direct_io, "_fallback_logged", False)
    opened = _direct_fds(monkeypatch)
    real_pwrite = os.pwrite

    def stricter(fd, data, off):
        if fd in opened:
            raise OSError(errno.EINVAL, "Invalid argument")  # alignment rules stricter than ALIGN
        return real_pwrite(fd, data, off)

    monkeypatch.setattr(os, "pwrite", stricter)
    with lines_of(direct_io.log, "WARNING") as out:
        _write(tmp_path, "refused_at_write", odd_sources, 64 << 10)
    lines = out.getvalue().splitlines()
    assert len(lines) == 1 and "page cache" in lines[0], lines


def test_choosing_the_page_cache_logs_nothing(tmp_path, monkeypatch, odd_sources):
    monkeypatch.setattr(direct_io, "_fallback_logged", False)
    monkeypatch.setenv(direct_io.ENV, "0")
    _refuse_o_direct_at_open(monkeypatch)  # were O_DIRECT tried, it would be refused and logged
    with lines_of(direct_io.log, "WARNING") as out:
        _write(tmp_path, "buffered", odd_sources, 64 << 10)
        assert not direct_io.supported([str(p) for p in tmp_path.rglob("*.pt")])
    assert out.getvalue() == ""
