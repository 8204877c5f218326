"""The write of the gather-free HF export planned by `direct.plan_export` (collective over the
checkpoint's gloo group; after the DCP shards, in async mode on the background thread, from the staged
copy): rank 0 lays the directory out (full-size files with their headers, the index, config.json and
generation_config.json as save_pretrained writes them), then every rank pwrites its boxes cast in chunks of
bucket_mb (a LoRA-merged output's rows computed a few at a time, A all-gathered), fsyncs, and all ranks
agree on the outcome. A rank's extra host memory is one chunk."""

from __future__ import annotations

import contextlib
import os
from typing import Any

import torch
import torch.distributed as dist

import slimckpt.layout.safetensors_layout as layout
from slimckpt.dist.outcome import Failure, agree, failure_of, from_rank0
from slimckpt.engine.out_files import OutputFiles
from slimckpt.engine.share_writer import as_bytes, byte_buffer, lora_merged, staged
from slimckpt.hf.lay_out import lay_out
from slimckpt.hf.plan import ExportPlan
from slimckpt.layout.export_assign import Box, run_starts, take_pieces
from slimckpt.layout.names import HF_SUBDIR
from slimckpt.log import get_logger
from slimckpt.save.export.direct import (
    TORCH_DTYPES,
    ExportError,
    box_of,
    failure_line,
    hf_side,
    local_shard,
    on_a_rank,
    plain_outcome,
)
from slimckpt.save.target import SaveTarget
from slimckpt.storage import for_path

log = get_logger("slimckpt.hf_direct_export")


def _clear_old_weights(hf_dir: str) -> None:
    """Weight files and index of an earlier attempt (their split may differ from this plan's)."""
    store = for_path(hf_dir)
    for name in os.listdir(hf_dir):
        if (name.startswith("model") and name.endswith(".safetensors")) or name == layout.INDEX_NAME:
            store.remove(os.path.join(hf_dir, name))
    adapter_dir = os.path.join(hf_dir, "lora_adapter")
    if os.path.isdir(adapter_dir):
        for name in os.listdir(adapter_dir):
            if name.startswith("adapter_"):
                store.remove(os.path.join(adapter_dir, name))


def _lay_out(job: ExportPlan, local_path: str, target: SaveTarget) -> None:
    """Rank 0: the dir as hf.lay_out makes it (configs as save_pretrained writes them, full-size
    files with headers, the index; verl's save put the tokenizer there), over an earlier attempt's."""
    hf_dir = os.path.join(local_path, HF_SUBDIR)
    os.makedirs(hf_dir, exist_ok=True)
    _clear_old_weights(hf_dir)
    lay_out(hf_dir, job, hf_side(target, local_path), tokenizer=False)


class _BoxWriter:
    """This rank's boxes into the planned files, through the range writer (`engine.out_files`): each
    piece cast in chunks into its one staging buffer and written at its offset. No write-behind: the
    export's host memory stays one chunk, and a box's bytes are written when `write_box` returns
    (stream mode hands the live shard back to training then)."""

    def __init__(self, hf_dir: str, plan: layout.Plan, chunk_bytes: int) -> None:
        self.plan = plan
        self.chunk_bytes = max(1 << 16, chunk_bytes)
        self.out = OutputFiles(hf_dir, plan, byte_buffer, self.chunk_bytes, algo=None, write_behind=False)
        self._starts: dict[tuple[str, Box], list[int]] = {}

    def write_box(self, out_name: str, value: Any, box: Box, take: layout.Take, source_shape: tuple[int, ...]) -> int:
        """This rank's part of output `out_name`: the elements of its box of the source (`value`,
        its local shard) that the output takes, each piece cast in chunks and pwritten in place."""
        placement = self.plan.placements[out_name]
        spec = placement.spec
        dtype = TORCH_DTYPES[spec.dtype]
        local = local_shard(value)
        if tuple(local.shape) != box.size:
            raise ExportError(f"{out_name}: local shard shape {tuple(local.shape)} != planned {box.size}")
        starts = self._starts.get((take.source, box))
        if starts is None:  # outputs split off one source share its box's runs
            starts = self._starts[(take.source, box)] = run_starts(source_shape, box)
        # contiguous shards (FSDP's, staged copies) are viewed, not copied
        flat = local.reshape(-1)
        per_chunk = max(1, self.chunk_bytes // max(spec.itemsize, local.element_size()))
        written = 0
        for piece in take_pieces(source_shape, box, take.span, starts):
            offset = placement.begin + piece.out_start * spec.itemsize
            for a in range(piece.local_start, piece.local_end, per_chunk):
                data = as_bytes(staged(self.out, flat[a : min(piece.local_end, a + per_chunk)], dtype))
                self.out.submit(placement.file, data, offset)
                offset += len(data)
                written += len(data)
        return written

    def write_merged(
        self, out_name: str, w_value: Any, box: Box, take: layout.Take, a: torch.Tensor, b_rows: torch.Tensor
    ) -> int:
        """This rank's rows of a LoRA-merged output: W's box (`w_value`, its local shard) plus
        (B @ A) x scaling for the same rows (`b_rows`: B's rows of the box; `a`: all of A), a few
        rows at a time, in the output dtype as `slimckpt merge --merge_lora` computes them
        (share_writer.lora_merged)."""
        placement = self.plan.placements[out_name]
        dtype = TORCH_DTYPES[placement.spec.dtype]
        itemsize = placement.spec.itemsize
        local = local_shard(w_value)
        if tuple(local.shape) != box.size or tuple(b_rows.shape[:1]) != box.size[:1]:
            raise ExportError(
                f"{out_name}: local shard {tuple(local.shape)} / B rows {tuple(b_rows.shape)} != planned {box.size}"
            )
        width = take.shape[1]
        (r0, c0), (rows, cols) = box.offset, box.size
        window = None if cols == width else (c0, c0 + cols)
        a = a.to(dtype)
        # the fp32 product of whole rows is the largest piece: a quarter chunk of it at a time
        step = max(1, self.chunk_bytes // (4 * width * 4))
        written = 0
        for s in range(0, rows, step):
            e = min(rows, s + step)
            merged = lora_merged(local[s:e].to(dtype), b_rows[s:e].to(dtype), a, take.delta.scaling, window)
            runs = (
                [(placement.begin + (r0 + s) * width * itemsize, merged)]
                if window is None
                else [(placement.begin + ((r0 + i) * width + c0) * itemsize, merged[i - s]) for i in range(s, e)]
            )
            for offset, piece in runs:
                data = as_bytes(piece.contiguous())
                self.out.submit(placement.file, data, offset)
                written += len(data)
        return written

    def close(self, sync: bool) -> None:
        """fsync (`sync`) and close the files; without `sync` the output is being discarded."""
        self._starts.clear()
        if sync:
            self.out.close()
        else:
            self.out.abort()


def _gathered(value: Any, shape: tuple[int, ...], group, local: torch.Tensor | None = None) -> torch.Tensor:
    """Collective over `group`: the whole tensor (a LoRA A [r, in] or B [out, r]: small) on the host,
    from every rank's box of it (`local`, read by the caller, else the shard of `value`)."""
    _, _, box = box_of(value)
    if box is not None:
        local = (local if local is not None else local_shard(value)).detach().to("cpu", copy=True)
    parts: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(parts, (box, local if box is not None else None), group=group)
    whole: torch.Tensor | None = None
    seen = torch.zeros(shape, dtype=torch.bool)
    for part_box, part in parts:
        if part_box is None:
            continue
        if whole is None:
            whole = torch.empty(shape, dtype=part.dtype)
        where = tuple(slice(o, o + n) for o, n in zip(part_box.offset, part_box.size))
        whole[where] = part
        seen[where] = True
    if whole is None or not bool(seen.all()):
        raise ExportError(f"the ranks' shards of a LoRA tensor of shape {list(shape)} do not cover it")
    return whole


def _gathered_read(
    reads: _Reads, model_state: dict[str, Any], name: str, shape: tuple[int, ...], group
) -> torch.Tensor:
    """_gathered of `name`, its local part read through `reads` when this rank holds one."""
    if box_of(model_state[name])[2] is None:
        return _gathered(model_state[name], shape, group)
    local = local_shard(reads.begin(name))
    try:
        return _gathered(model_state[name], shape, group, local)
    finally:
        reads.end(name)


def _held_rows(value: Any, box: Box, local: torch.Tensor | None = None) -> torch.Tensor:
    """The rows of `box` (of W) in this rank's shard of B (b_rows_elsewhere checked it holds them)."""
    _, _, b_box = box_of(value)
    start = box.offset[0] - b_box.offset[0]
    return (local if local is not None else local_shard(value))[start : start + box.size[0]]


class _Reads:
    """Where write_export reads a source: the state dict (sync, pool), or through stream mode's
    StreamReads, which must be told when each read ends (sources_read lists the same reads)."""

    def __init__(self, model_state: dict[str, Any], stream: Any) -> None:
        self.model_state, self.stream = model_state, stream

    def begin(self, name: str) -> Any:
        return self.stream.begin(name) if self.stream is not None else self.model_state[name]

    def end(self, name: str) -> None:
        if self.stream is not None:
            self.stream.end(name)


def sources_read(job: ExportPlan, model_state: dict[str, Any]) -> list[str]:
    """The model tensors this rank's part of the export reads, one entry per read write_export
    makes: a plain output's source once per box; a merged output's W and (held rows of) B once per
    box, A (and a gathered B) once if this rank holds a part of it."""
    names: list[str] = []
    for out_name, _ in job.mine:
        take = job.takes[out_name]
        names.append(take.source)
        if take.delta is not None and out_name not in job.gather_b:
            names.append(take.delta.b)
    for out_name in job.merged_outputs:
        delta = job.takes[out_name].delta
        gathered = [delta.a] + ([delta.b] if out_name in job.gather_b else [])
        names += [n for n in gathered if box_of(model_state[n])[2] is not None]
    return names


def write_export(
    target: SaveTarget,
    job: ExportPlan,
    local_path: str,
    model_state: dict[str, Any],
    config: Any,
    group,
    stream_reads: Any = None,
) -> int:
    """Collective over `group`: rank 0 lays the files out, every rank writes its boxes from
    `model_state` (live shards in sync mode, the staged copy in pool mode), fsyncs, and all
    ranks raise the same error if any failed. Returns the bytes this rank wrote. `stream_reads`
    (stream mode, stream_capture.StreamReads) hands out each source read (sources_read lists
    them) and is told when the read is over."""
    rank = dist.get_rank(group)
    describe = lambda exc: failure_line(exc, local_path)  # noqa: E731
    plain_outcome(lambda: from_rank0(group, lambda: _lay_out(job, local_path, target), on_a_rank, describe))

    writer = _BoxWriter(os.path.join(local_path, HF_SUBDIR), job.plan, int(config.bucket_mb) << 20)
    written = 0
    failure: BaseException | None = None
    reads = _Reads(model_state, stream_reads)
    try:
        for out_name, box in job.mine:
            take = job.takes[out_name]
            if take.delta is None:
                value = reads.begin(take.source)
                written += writer.write_box(out_name, value, box, take, job.source_shapes[take.source])
                reads.end(take.source)
    except Exception as exc:  # noqa: BLE001 - reported to every rank, after the gathers below
        failure = exc
    # merged outputs: every rank joins each A's all-gather, in the job's order, even after a failure
    for out_name in job.merged_outputs:
        take = job.takes[out_name]
        a = _gathered_read(reads, model_state, take.delta.a, job.source_shapes[take.delta.a], group)
        b_full = (
            _gathered_read(reads, model_state, take.delta.b, job.source_shapes[take.delta.b], group)
            if out_name in job.gather_b
            else None
        )
        if failure is not None:
            continue
        try:
            for name, box in job.mine:
                if name == out_name:
                    w = reads.begin(take.source)
                    if b_full is not None:
                        b_rows = b_full[box.offset[0] : box.offset[0] + box.size[0]]
                    else:
                        b_rows = _held_rows(model_state[take.delta.b], box, local_shard(reads.begin(take.delta.b)))
                    written += writer.write_merged(name, w, box, take, a, b_rows)
                    reads.end(take.source)
                    if b_full is None:
                        reads.end(take.delta.b)
        except Exception as exc:  # noqa: BLE001
            failure = exc
        del a, b_full
    mine: Failure | None = None
    try:
        if failure is not None:
            raise failure
        writer.close(sync=True)
    except Exception as exc:  # noqa: BLE001 - reported to every rank
        with contextlib.suppress(Exception):
            writer.close(sync=False)
        mine = failure_of(exc, rank, describe)
    plain_outcome(lambda: agree(group, mine, on_a_rank))
    if rank == 0:
        with contextlib.suppress(OSError):  # the directory entries of the new files
            hf_dir = os.path.join(local_path, HF_SUBDIR)
            for_path(hf_dir).sync(hf_dir)
        log.info(
            "HF export %s: %d tensors, %.1f MiB in %d file(s), written in place by %d rank(s), no gather",
            os.path.join(local_path, HF_SUBDIR),
            len(job.plan.placements),
            job.plan.total_size / 2**20,
            len(job.plan.files),
            dist.get_world_size(group),
        )
    return written
