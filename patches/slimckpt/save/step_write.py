"""The write of a step: DCP shards, then the gather-free HF export, then the commit.

Runs in the foreground (sync mode) or on the background writer's thread (async modes), from the
live shards, the staged copy (pool) or the live shards read through a StreamCapture (stream).
Sync mode streams tensor by tensor to disk (host memory: write_threads x (bucket_mb + one
tensor) on GPU, one tensor on CPU). A failure on any rank leaves a failure marker in the role
dir, so the half-written step is never committed or loaded.
"""

from __future__ import annotations

import contextlib
import threading
import time
from typing import Any

import torch.distributed.checkpoint as dcp

import slimckpt.save.export.direct_write as hf_direct_write
from slimckpt.dist.lost_rank import RankLost, peer_loss_line
from slimckpt.engine.dcp_file_writer import BoundedFileSystemWriter
from slimckpt.engine.hashing_fs import HashingFileSystem
from slimckpt.engine.resume_records import write_failure
from slimckpt.log import get_logger
from slimckpt.options.checkpoint_options import CheckpointOptions
from slimckpt.save import step_commit
from slimckpt.save.modes.stream_capture import StreamReads
from slimckpt.save.modes.stream_planner import StreamSavePlanner
from slimckpt.save.save_context import SaveContext
from slimckpt.storage import absolute, for_path

log = get_logger("slimckpt.resume")


def storage_writer(path: str, config: CheckpointOptions):
    """DCP's FileSystemWriter, holding one tensor per thread in host memory (write.dcp_file_writer),
    with a filesystem that checksums each file as it is written."""
    writer = BoundedFileSystemWriter(
        path,
        single_file_per_rank=True,
        # a local file is fsynced; an object store's upload is durable once completed, and torch's
        # own sync of a stream without a descriptor would be a whole-host os.sync()
        sync_files=for_path(path).is_local,
        thread_count=int(config.write_threads),
        per_thread_copy_ahead=int(config.bucket_mb) * 2**20,
        overwrite=True,
    )
    writer.fs = HashingFileSystem()
    writer.path = writer.fs.init_path(path)
    return writer


def written_checksums(writer: Any, local_path: str) -> dict[str, str]:
    """{path relative to the role dir: checksum} of the files a storage_writer wrote."""
    sums = getattr(getattr(writer, "fs", None), "checksums", {})
    root = absolute(local_path).rstrip("/") + "/"
    return {p[len(root) :] if p.startswith(root) else p: c for p, c in sums.items()}


def _after_shards(ctx: SaveContext, model_state: dict[str, Any] | None = None, reads: Any = None) -> None:
    """The gather-free HF export (hf_direct_write: every rank writes its own rows of the final
    safetensors files at their planned offsets). It runs after the shards are on disk and before
    the manifest, whose file list then includes huggingface/: a committed step always has its
    whole export, a half-written one is never committed."""
    if ctx.export is None or not ctx.config.export_hf:
        return
    start = time.perf_counter()
    hf_direct_write.write_export(
        ctx.target, ctx.export, ctx.local_path, model_state or {}, ctx.config, ctx.group, stream_reads=reads
    )
    ctx.timings["export_hf"] = time.perf_counter() - start


def write_and_commit(ctx: SaveContext, state: dict[str, Any]) -> None:
    """DCP shards, then the HF export (both from `state`: the live shards, the staged copy in
    pool mode, or the live shards read through `ctx.capture` in stream mode), then the commit.
    Collective over `ctx.group`."""
    timings, capture = ctx.timings, ctx.capture
    start = time.perf_counter()
    try:
        if ctx.first is not None:  # rank 0: retention's optimizer drops (make_room), before the shards
            ctx.first()
            timings["drop_optimizer"] = time.perf_counter() - start
            start = time.perf_counter()
        known: dict[str, str] = {}
        reads = None
        if capture is not None:
            if ctx.export is not None and ctx.config.export_hf:
                model_state = state.get("model", {})
                reads = StreamReads(capture, model_state)
                capture.plan_reads("export", reads.keys_for(hf_direct_write.sources_read(ctx.export, model_state)))
            if not state:
                capture.start()
        if state:
            writer = storage_writer(ctx.dcp_dir, ctx.config)
            planner = StreamSavePlanner(capture) if capture is not None else None
            try:
                dcp.save(state, storage_writer=writer, planner=planner, process_group=ctx.group)
            finally:
                if capture is not None:
                    capture.dcp_done()
            known = written_checksums(writer, ctx.local_path)  # hashed as written: no read-back
        timings["write"] = time.perf_counter() - start
        _after_shards(ctx, state.get("model", {}), reads)
        if capture is not None:  # a shard changed under the writer is never committed
            capture.check_collective(ctx.group)
            timings["guard_blocked"] = capture.blocked_s
        step_commit.commit(ctx, known)
    except BaseException as exc:
        with contextlib.suppress(Exception):
            write_failure(ctx.local_path, ctx.target.rank, f"step {ctx.step}: {type(exc).__name__}: {exc}")
        line = peer_loss_line(exc, ctx.local_path, ctx.step)
        if line is not None and threading.current_thread() is not threading.main_thread():
            # a background write: said now, not only when the next save or the exit waits for it
            log.error("%s", line)
            raise RankLost(line) from exc
        raise


__all__ = ["storage_writer", "write_and_commit", "written_checksums"]
