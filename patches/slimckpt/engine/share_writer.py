"""Positional writes of planned byte ranges: headers, then row ranges cast in bounded chunks.

Each output file is created once at its final size (space reserved up front where the filesystem
allows, so a full disk fails before the long part), then any number of workers `os.pwrite` their
own disjoint ranges into it. A chunk is at most `chunk_bytes` of source, cast into a reused
staging buffer; a chunk already in the output dtype is written straight from the mmap.

Casting and writing overlap: the caller casts chunk k+1 into a staging buffer while write-behind
threads pwrite the chunks before it. Both release the GIL, so one worker keeps the disk busy; host
memory is a few chunks. The rank files are read through the page cache (the cast's page faults on
the mmap, the kernel reading ahead). Each chunk is cast at an address that matches its file offset,
so its whole 4 KiB blocks are written around the page cache (O_DIRECT, two writes in flight) and
only the bytes at its two ends through it; every file is fsync'ed before the commit. Buffered writes
of the output fell behind the kernel's writeback and slowed the input's reads; O_DIRECT reads were
slower than the page cache's readahead (one request in flight) and stay out (measured:
BENCHMARKS.md, Figures quoted in the code).

An output that is a part of a checkpoint tensor (a `layout.Take` with a span: one expert split off
a fused MoE tensor) is written the same way from a flat view of each dim-0 shard, in chunks of
elements; a part of a tensor sharded on another dim, or held unsharded by every rank, is cut from
the few source rows that hold each chunk.
"""

from __future__ import annotations

import math
import os
import time
from dataclasses import dataclass

import torch

import slimckpt.layout.safetensors_layout as layout
from slimckpt.engine.out_files import OutputFiles, Progress
from slimckpt.engine.verl_sources import CheckpointError, SourceTensor
from slimckpt.engine.writer_stats import WriterStats
from slimckpt.layout.merge_manifest import DEFAULT_ALGO, file_checksum
from slimckpt.layout.names import DEFAULT_CHUNK_BYTES, torch_dtypes_of_choices

OUT_DTYPES: dict[str, torch.dtype] = torch_dtypes_of_choices(torch)


def as_bytes(t: torch.Tensor) -> memoryview:
    t = t.reshape(-1)
    if t.numel() == 0:
        return memoryview(b"")
    return memoryview(t.view(torch.uint8).numpy()).cast("B")


@dataclass
class _RowChunk:
    """Rows [start, end) of a dim-0 shard `piece`, written as `nbytes` at `offset` of `file`."""

    file: str
    piece: torch.Tensor
    start: int
    end: int
    offset: int
    nbytes: int  # in the output dtype


@dataclass
class _DeltaSegment:
    """Rows [start, end) of a weight with a LoRA adapter merged in (`layout.LoraDelta`)."""

    name: str
    start: int
    end: int


@dataclass
class _SliceSegment:
    """Output elements [start, end) of a part-of-a-tensor output, cut from whole source rows."""

    name: str
    start: int
    end: int


class ShareWriter:
    """Writes one worker's share of a plan into the files `create_files` made; `takes` says which
    outputs are parts of their source (by default every output is its whole source)."""

    def __init__(
        self,
        root: str,
        plan: layout.Plan,
        sources: dict[str, SourceTensor],
        out_dtype: torch.dtype,
        chunk_bytes: int = DEFAULT_CHUNK_BYTES,
        progress: Progress | None = None,
        algo: str = DEFAULT_ALGO,
        fsync: bool = True,
        takes: dict[str, layout.Take] | None = None,
        lora_sources: dict[str, SourceTensor] | None = None,
        stats: WriterStats | None = None,
        direct: bool = True,
    ) -> None:
        self.plan, self.sources, self.out_dtype = plan, sources, out_dtype
        self.stats = stats if stats is not None else WriterStats()  # where the time went, added up over shares
        self.spans = {name: t.span for name, t in (takes or {}).items() if not t.whole}
        # outputs with a LoRA adapter merged in; their A and B by checkpoint name in `lora_sources`
        self.deltas = {name: t.delta for name, t in (takes or {}).items() if t.delta is not None}
        self.lora_sources = lora_sources or {}
        self.out_width = torch.empty((), dtype=out_dtype).element_size()
        self.chunk_bytes = max(1, chunk_bytes)
        address = buffer_address if direct else None  # `direct`: whole blocks around the page cache
        self.out = OutputFiles(root, plan, byte_buffer, self.chunk_bytes, progress, algo, fsync, address=address)

    @property
    def checksums(self) -> dict[str, str]:
        return self.out.checksums

    def close(self) -> None:
        self.out.close()

    def abort(self) -> None:
        self.out.abort()

    # -- tensors ---------------------------------------------------------------------------------
    def write_share(self, share: list[layout.Segment]) -> None:
        start = time.perf_counter()
        items = self._chunks(share)
        row_chunks = [it.nbytes for it in items if isinstance(it, _RowChunk)]
        if row_chunks:  # cast buffers of the output size (half the source chunk for fp32 -> bf16)
            self.out.ring.min_bytes = max(row_chunks)
        try:
            for item in items:
                self._write_item(item)
        except BaseException:
            self.abort()
            raise
        closing = time.perf_counter()
        self.close()
        self.stats.close_s += time.perf_counter() - closing
        self.stats.wall_s += time.perf_counter() - start

    def _chunks(self, share: list[layout.Segment]) -> list[_RowChunk | layout.Segment | _SliceSegment]:
        """The share in write order: dim-0 shards as row chunks (each read, cast and written as one
        piece), other segments whole (their writers chunk them themselves)."""
        out: list[_RowChunk | layout.Segment | _SliceSegment] = []
        for seg in share:
            src = self.sources[seg.name]
            placement = self.plan.placements[seg.name]
            if seg.row_end <= seg.row_start or placement.end == placement.begin:
                continue
            if seg.name in self.spans:
                out.extend(self._slice_chunks(seg, src, placement))
                continue
            if seg.name in self.deltas:
                out.append(_DeltaSegment(seg.name, seg.row_start, seg.row_end))
                continue
            if src.shard_dim != 0:
                out.append(seg)
                continue
            for sr in layout.source_ranges(placement, src.shard_sizes, seg.row_start, seg.row_end):
                t = src.pieces[sr.source]
                t = t.reshape(1) if t.dim() == 0 else t
                row_out = (t[0].numel() if t.shape[0] else 0) * self.out_width
                step = self._rows_per_chunk(t)
                offset = sr.begin
                for start in range(sr.local_start, sr.local_end, step):
                    end = min(sr.local_end, start + step)
                    chunk = _RowChunk(placement.file, t, start, end, offset, (end - start) * row_out)
                    out.append(chunk)
                    offset += chunk.nbytes
        return out

    def _slice_chunks(
        self, seg: layout.Segment, src: SourceTensor, placement: layout.Placement
    ) -> list[_RowChunk | _SliceSegment]:
        """Rows [row_start, row_end) of an output that is elements [span) of its source. From dim-0
        shards (contiguous, as FSDP and torch.load leave them): flat element chunks of each shard,
        read and written like row chunks (so too from a single unsharded copy); else one `_SliceSegment`."""
        spec = placement.spec
        per_row = spec.numel // spec.rows if spec.rows else 0
        e0, e1 = seg.row_start * per_row, seg.row_end * per_row
        one_copy = src.shard_dim is None and len(src.pieces) == 1  # a replicated DTensor, or world size 1
        if not (src.shard_dim == 0 or one_copy) or not all(p.is_contiguous() for p in src.pieces):
            return [_SliceSegment(seg.name, e0, e1)]
        flat = [p.reshape(-1) for p in src.pieces]
        step = max(1, self.chunk_bytes // max(src.pieces[0].element_size(), self.out_width))
        out: list[_RowChunk | _SliceSegment] = []
        for r in layout.take_ranges(self.spans[seg.name][0], [p.numel() for p in flat], e0, e1):
            offset = placement.begin + r.out_start * self.out_width
            for start in range(r.local_start, r.local_end, step):
                end = min(r.local_end, start + step)
                out.append(
                    _RowChunk(placement.file, flat[r.source], start, end, offset, (end - start) * self.out_width)
                )
                offset += (end - start) * self.out_width
        return out

    def _write_item(self, item: _RowChunk | layout.Segment | _SliceSegment) -> None:
        if isinstance(item, _SliceSegment):
            self._write_slice_by_rows(item)
            return
        if isinstance(item, _DeltaSegment):
            self._write_lora_merged(item)
            return
        if not isinstance(item, _RowChunk):
            src = self.sources[item.name]
            placement = self.plan.placements[item.name]
            if src.shard_dim is not None:
                self._write_cat_rows(placement, src, item.row_start, item.row_end)
            else:
                self._write_plain(placement, src, item.row_start, item.row_end)
            return
        data = as_bytes(self._cast(item.piece[item.start : item.end], item.offset))
        self.out.submit(item.file, data, item.offset)

    def _cast(self, src: torch.Tensor, at: int) -> torch.Tensor:
        return staged(self.out, src, self.out_dtype, self.stats, at)

    def _rows_per_chunk(self, t: torch.Tensor) -> int:
        per_row = max(1, t[0].numel() if t.dim() and t.shape[0] else 1)
        width = max(t.element_size(), self.out_width)
        return max(1, self.chunk_bytes // (per_row * width))

    def _write_cat_rows(self, placement: layout.Placement, src: SourceTensor, a: int, b: int) -> None:
        """Shard(d>0): each output row is the concatenation of every shard's slice of that row."""
        step = max(1, self._rows_per_chunk(src.pieces[0]) // max(1, len(src.pieces)))
        offset = placement.rows_to_bytes(a, b)[0]
        for start in range(a, b, step):
            end = min(b, start + step)
            chunk = torch.cat([p[start:end].to(self.out_dtype) for p in src.pieces], dim=src.shard_dim)
            data = as_bytes(chunk.contiguous())
            self.out.submit(placement.file, data, offset)
            offset += len(data)

    def _write_plain(self, placement: layout.Placement, src: SourceTensor, a: int, b: int) -> None:
        """An unsharded tensor: rank 0's copy, after checking the others equal it as verl does."""
        first = src.pieces[0].reshape(1) if src.pieces[0].dim() == 0 else src.pieces[0]
        others = [p.reshape(1) if p.dim() == 0 else p for p in src.pieces[1:]]
        step = self._rows_per_chunk(first)
        offset = placement.rows_to_bytes(a, b)[0]
        for start in range(a, b, step):
            end = min(b, start + step)
            chunk = self._cast(first[start:end], offset)
            for k, other in enumerate(others, start=1):
                # verl compares the copies after its bf16 cast; compare after ours
                if not torch.equal(other[start:end].to(self.out_dtype), chunk):
                    raise CheckpointError(
                        f"{src.file_of(k)}: unsharded entry {src.name!r} differs from rank {src.ranks[0]}'s copy; "
                        f"the rank files come from different steps: re-copy the checkpoint"
                    )
            data = as_bytes(chunk)
            self.out.submit(placement.file, data, offset)
            offset += len(data)

    def _write_slice_by_rows(self, item: _SliceSegment) -> None:
        """Output elements [start, end) of a part of a source that is sharded on dim d > 0 or held
        whole by every rank: per chunk, the source rows holding it (every shard's slice of them
        concatenated; rank 0's copy, the others compared as in `_write_plain`), cut to the chunk.
        Rows are fetched once and kept while the next chunks fall in them (a fused expert's row is
        many chunks): memory is a chunk's worth of rows, or the two rows one chunk spans."""
        src = self.sources[item.name]
        placement = self.plan.placements[item.name]
        span0 = self.spans[item.name][0]
        rows_total = src.shape[0] if src.shape else 1
        row_elems = math.prod(src.shape[1:]) if src.shape else 1
        step = max(1, self.chunk_bytes // max(src.pieces[0].element_size(), self.out_width))
        offset = placement.begin + item.start * self.out_width
        held, h0, h1 = None, 0, 0  # rows [h0, h1) of the source, flat
        for a in range(item.start, item.end, step):
            g0, g1 = span0 + a, span0 + min(item.end, a + step)
            r0, r1 = g0 // row_elems, -(-g1 // row_elems)
            if held is None or r0 < h0 or r1 > h1:
                held = None  # free the old rows before the new ones are made
                h0, h1 = r0, min(rows_total, max(r1, r0 + step // row_elems))
                held = self._source_rows(src, h0, h1).reshape(-1)
            chunk = held[g0 - h0 * row_elems : g1 - h0 * row_elems]
            data = as_bytes(self._cast(chunk, offset))
            self.out.submit(placement.file, data, offset)
            offset += len(data)

    def _write_lora_merged(self, item: _DeltaSegment) -> None:
        """Rows [start, end) of W + (B @ A) * scaling, as peft's `merge_and_unload()` computes it on a CPU
        from W, A and B in the output dtype (`lora_merged`): per chunk, W's and B's rows of it, and A
        (r x in, read once). Memory: A and about one chunk."""
        delta = self.deltas[item.name]
        w_src = self.sources[item.name]
        a_src, b_src = self.lora_sources[delta.a], self.lora_sources[delta.b]
        placement = self.plan.placements[item.name]
        a = self._source_rows(a_src, 0, a_src.shape[0])
        # an eighth of a chunk of rows: W in the output dtype, B @ A in fp32 and the result are held at
        # once, and freed blocks stay in the allocator's heap; an eighth adds nothing to a plain merge's
        # peak, a quarter does (tests/merge/test_memory.py; measured: BENCHMARKS.md, Figures quoted in the code)
        step = max(1, self._rows_per_chunk(w_src.pieces[0]) // 8)
        offset = placement.rows_to_bytes(item.start, item.end)[0]
        for start in range(item.start, item.end, step):
            end = min(item.end, start + step)
            merged = lora_merged(
                self._source_rows(w_src, start, end), self._source_rows(b_src, start, end), a, delta.scaling
            )
            data = as_bytes(self._cast(merged, offset))
            self.out.submit(placement.file, data, offset)
            offset += len(data)

    def _source_rows(self, src: SourceTensor, r0: int, r1: int) -> torch.Tensor:
        """Dim-0 rows [r0, r1) of the whole source tensor, in the output dtype, contiguous."""
        if src.shard_dim is None:
            first = src.pieces[0].reshape(1) if src.pieces[0].dim() == 0 else src.pieces[0]
            rows = first[r0:r1].to(self.out_dtype)
            for k, other in enumerate(src.pieces[1:], start=1):
                other = other.reshape(1) if other.dim() == 0 else other
                if not torch.equal(other[r0:r1].to(self.out_dtype), rows):
                    raise CheckpointError(
                        f"{src.file_of(k)}: unsharded entry {src.name!r} differs from rank {src.ranks[0]}'s copy; "
                        f"the rank files come from different steps: re-copy the checkpoint"
                    )
            return rows.contiguous()
        if src.shard_dim == 0:
            parts, base = [], 0
            for p in src.pieces:
                a, b = max(r0, base), min(r1, base + p.shape[0])
                if a < b:
                    parts.append(p[a - base : b - base].to(self.out_dtype))
                base += p.shape[0]
            return torch.cat(parts, dim=0).contiguous()
        return torch.cat([p[r0:r1].to(self.out_dtype) for p in src.pieces], dim=src.shard_dim).contiguous()


def byte_buffer(nbytes: int) -> torch.Tensor:
    """A staging buffer of `OutputFiles` (its `alloc`) for a writer of torch tensors."""
    return torch.empty(nbytes, dtype=torch.uint8)


def buffer_address(buf: torch.Tensor) -> int:
    """Where a `byte_buffer` starts in memory (`OutputFiles`' `address`)."""
    return buf.data_ptr()


def staged(
    out: OutputFiles, src: torch.Tensor, dtype: torch.dtype, stats: WriterStats | None = None, at: int | None = None
) -> torch.Tensor:
    """`src` in `dtype`, contiguous, on the host: as is when it already is and `out` writes through
    the page cache (the write reads it straight from the mmap or the live shard, no copy), else cast
    into `out`'s next staging buffer (reused, no allocation per chunk; placed for file offset `at`,
    so that a writer around the page cache can send it as is), which the `out.submit` of its bytes
    hands back. With `stats`, the copy is added to its `cast_s`; the wait for a free staging buffer
    is not (that is the writes' time, and counting it as the cast's would hide where a merge waits)."""
    around = out.address is not None and at is not None
    if src.dtype == dtype and src.is_contiguous() and src.device.type == "cpu" and not around:
        return src
    nbytes = src.numel() * dtype.itemsize
    buf = out.stage(nbytes, at)[:nbytes].view(dtype).view(src.shape)
    t0 = time.perf_counter()
    buf.copy_(src)  # from the mmap: its page faults (the reads) are timed as the cast's
    if stats is not None:
        stats.cast_s += time.perf_counter() - t0
    return buf


def lora_merged(
    w: torch.Tensor, b: torch.Tensor, a: torch.Tensor, scaling: float, cols: tuple[int, int] | None = None
) -> torch.Tensor:
    """W + (B @ A) * scaling as peft 0.21's `merge_and_unload()` makes it of a model and adapter loaded
    in W's dtype (`PeftModel.from_pretrained`, which keeps a bf16/fp16 adapter in fp32:
    autocast_adapter_dtype): the delta (B @ A) * scaling in fp32, added to W in fp32 (`W += delta`
    promotes) and rounded to W's dtype once. The one arithmetic of `slimckpt merge --merge_lora` and
    the incremental tier's merged export. `cols` (W holds only those columns of the weight, a
    column shard): the product is still of whole rows, so every element is computed as for the
    whole weight, then cut."""
    # in place on the product: W + delta == delta + W (IEEE addition commutes), W cast on the fly
    acc = b.float() @ a.float()
    acc.mul_(scaling)
    if cols is not None:
        acc = acc[:, cols[0] : cols[1]]
    acc.add_(w)
    return acc if w.dtype == torch.float32 else acc.to(w.dtype)


def checksum_files(root: str, names: list[str], algo: str = DEFAULT_ALGO) -> dict[str, str]:
    """Read-back checksums of whole files (those no single writer wrote in order)."""
    return {name: file_checksum(os.path.join(root, name), algo) for name in names}
