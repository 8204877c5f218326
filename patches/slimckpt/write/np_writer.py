"""The merge's early writer without torch: the same bytes as `writer.ShareWriter`, written by a
process forked before the merge imports torch.

`slimckpt merge` spends its first 1.3-4 s here importing torch, then transformers. The
weights do not need any of them for the common checkpoint (FSDP's dim-0 shards, plain and
replicated tensors, fp32 or bf16): `pt_index` finds each shard's bytes in the rank files without
torch, `direct_read.Prefetcher` reads them with O_DIRECT, `np_cast` casts them as torch would, and
`out_files` writes them exactly as the torch writer does. So the disk starts working a few hundred
milliseconds after the command starts, instead of after torch's import.

What this writer does not reproduce exactly it refuses (`Declined`) before writing (other shard
dims, dtype pairs `np_cast` does not do, filesystems without O_DIRECT) or while writing (a NaN,
whose bit pattern after torch's cast depends on the CPU; plain copies that differ between rank
files, which the torch writer reports in its own words). The merge then writes those weights with
torch, as it does when its guess of the layout is wrong.

No torch here, by design.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass

from ..format import layout
from ..format.merge_manifest import DEFAULT_ALGO
from ..read import direct_io, direct_read
from . import np_cast
from .out_files import OutputFiles
from .writer_stats import WriterStats


class Declined(Exception):
    """These weights need the torch writer; str() says why (logged)."""


@dataclass
class _Chunk:
    """Output bytes [offset, offset + nbytes) of `file`: source reads `reads` (the first is written,
    the others are rank copies that must cast to the same bytes), cast by `caster`."""

    file: str
    offset: int
    nbytes: int
    reads: list[int]  # positions in the prefetcher's read list
    caster: np_cast.Caster
    name: str


def check(sources: dict, out_dtype: str) -> None:
    """Raise Declined unless every tensor is one this writer reproduces exactly."""
    for name, src in sources.items():
        if src.shard_dim not in (0, None):
            raise Declined(f"{name} is sharded on dim {src.shard_dim}")
        if not np_cast.supported(src.dtype, out_dtype):
            raise Declined(f"{name}: no numpy cast from {src.dtype} to {out_dtype}")
    paths = sorted({p.path for src in sources.values() for p in src.pieces})
    if not direct_io.supported(paths):
        raise Declined("the rank files cannot be read with O_DIRECT here")


def write_plan(
    root: str,
    plan: layout.Plan,
    sources: dict,
    out_dtype: str,
    chunk_bytes: int,
    progress: Callable[[int], None] | None = None,
    fsync: bool = True,
    algo: str = DEFAULT_ALGO,
    stats: WriterStats | None = None,
    takes: dict[str, layout.Take] | None = None,
) -> dict[str, str]:
    """Every weight byte of `plan` (files made by `out_files.create_files`), from `sources`
    ({output name: pt_index.IndexedTensor}); returns the checksums of the files written. `takes`
    says which outputs are parts of their source (default: none). `stats`, when given, receives
    where the time went."""
    start = time.perf_counter()
    check(sources, out_dtype)
    spans = {name: t.span for name, t in (takes or {}).items() if not t.whole}
    chunks, reads = _chunks(plan, sources, out_dtype, max(1, chunk_bytes), spans)
    out = OutputFiles(root, plan, direct_io.aligned_buffer, chunk_bytes, progress, algo, fsync)
    out.ring.min_bytes = max((c.nbytes for c in chunks), default=1)
    prefetch = direct_read.Prefetcher(reads)
    timing = stats if stats is not None else WriterStats()
    try:
        for chunk in chunks:
            _write_chunk(out, prefetch, chunk, timing)
    except BaseException:
        out.abort()
        raise
    finally:
        prefetch.close()
    closing = time.perf_counter()
    out.close()
    timing.close_s = time.perf_counter() - closing
    timing.wall_s = time.perf_counter() - start
    timing.read_s, timing.wait_buffer_s = prefetch.read_s, prefetch.wait_buffer_s
    timing.read_bytes, timing.read_threads = prefetch.read_bytes, len(prefetch.threads)
    return out.checksums


def _write_chunk(out: OutputFiles, prefetch: direct_read.Prefetcher, c: _Chunk, timing: WriterStats) -> None:
    buf = memoryview(out.stage(c.nbytes))
    shift = c.offset % direct_io.ALIGN  # the cast lands at the file offset modulo ALIGN: O_DIRECT-able
    data = buf[shift : shift + c.nbytes]
    try:
        for k, i in enumerate(c.reads):
            t0 = time.perf_counter()
            src = prefetch.get(i)
            t1 = time.perf_counter()
            if k == 0:
                c.caster.cast(src, data)
            else:  # a rank copy: it must cast to the bytes already staged
                copy = bytearray(c.nbytes)
                c.caster.cast(src, memoryview(copy))
                if copy != data:
                    raise Declined(f"{c.name}: the rank files' copies differ")
            timing.wait_read_s += t1 - t0
            timing.cast_s += time.perf_counter() - t1
    except np_cast.HasNaN:
        raise Declined(f"{c.name} holds NaN") from None
    out.submit(c.file, data, c.offset)


def _chunks(
    plan: layout.Plan, sources: dict, out_dtype: str, chunk_bytes: int, spans: dict[str, tuple[int, int]] | None = None
) -> tuple[list[_Chunk], list[direct_read.ChunkRead]]:
    """The plan in write order as chunks of at most `chunk_bytes` of source each, and the reads
    they need, in the order they need them. An output in `spans` is that run of its source's
    elements: its chunks count elements, not rows, and may cross the source's rows."""
    chunks: list[_Chunk] = []
    reads: list[direct_read.ChunkRead] = []
    casters: dict[str, np_cast.Caster] = {}  # one per source dtype: each keeps its own scratch block
    for seg in layout.partition(plan, 1)[0]:
        src = sources[seg.name]
        placement = plan.placements[seg.name]
        if seg.row_end <= seg.row_start or placement.end == placement.begin:
            continue
        caster = casters.get(src.dtype) or casters.setdefault(src.dtype, np_cast.Caster(src.dtype, out_dtype))
        if spans and seg.name in spans:
            _slice_chunks(chunks, reads, seg, src, placement, spans[seg.name][0], caster, chunk_bytes)
            continue
        row_items = layout.dim0_row_bytes(src.shape, 1) if src.shape else 1  # elements per output row
        step = max(1, chunk_bytes // (row_items * max(src.itemsize, caster.out_width)))
        if src.shard_dim == 0:
            sizes = [p.shape[0] for p in src.pieces]
            ranges = [
                (sr.source, sr.local_start, sr.local_end, sr.begin)
                for sr in layout.source_ranges(placement, sizes, seg.row_start, seg.row_end)
            ]
            copies = None
        else:  # plain or replicated: rank 0's copy written, the others compared, as verl does
            begin = placement.rows_to_bytes(seg.row_start, seg.row_end)[0]
            ranges = [(0, seg.row_start, seg.row_end, begin)]
            copies = range(len(src.pieces))
        for source, a, b, offset in ranges:
            for start in range(a, b, step):
                end = min(b, start + step)
                src_bytes = (end - start) * row_items * src.itemsize
                positions = []
                for k in copies if copies is not None else (source,):
                    piece = src.pieces[k]
                    positions.append(len(reads))
                    reads.append(
                        direct_read.ChunkRead(piece.path, piece.offset + start * row_items * src.itemsize, src_bytes)
                    )
                nbytes = caster.out_nbytes(src_bytes)
                chunks.append(_Chunk(placement.file, offset, nbytes, positions, caster, seg.name))
                offset += nbytes
    return chunks, reads


def _slice_chunks(
    chunks: list[_Chunk],
    reads: list[direct_read.ChunkRead],
    seg: layout.Segment,
    src,
    placement: layout.Placement,
    span_start: int,
    caster: np_cast.Caster,
    chunk_bytes: int,
) -> None:
    """Rows [row_start, row_end) of an output that is its source's elements from `span_start` on:
    element chunks of each dim-0 shard (or of rank 0's copy, the others compared)."""
    spec = placement.spec
    per_row = spec.numel // spec.rows if spec.rows else 0
    e0, e1 = seg.row_start * per_row, seg.row_end * per_row
    numel = [math.prod(p.shape) for p in src.pieces]
    if src.shard_dim == 0:
        ranges = [
            (r.source, r.local_start, r.local_end, r.out_start) for r in layout.take_ranges(span_start, numel, e0, e1)
        ]
        copies = None
    else:
        ranges = [(0, span_start + e0, span_start + e1, e0)]
        copies = range(len(src.pieces))
    step = max(1, chunk_bytes // max(src.itemsize, caster.out_width))
    for source, a, b, out_start in ranges:
        offset = placement.begin + out_start * caster.out_width
        for start in range(a, b, step):
            end = min(b, start + step)
            positions = []
            for k in copies if copies is not None else (source,):
                piece = src.pieces[k]
                positions.append(len(reads))
                reads.append(
                    direct_read.ChunkRead(piece.path, piece.offset + start * src.itemsize, (end - start) * src.itemsize)
                )
            nbytes = (end - start) * caster.out_width
            chunks.append(_Chunk(placement.file, offset, nbytes, positions, caster, seg.name))
            offset += nbytes
