"""Where a merge's bytes get written: in this process, or in spawned worker processes (one per
share of the plan, `--workers N`), each with its own `writer.ShareWriter`; the parent collects
progress, checksums and the first error. Torchrun ranks of `--distributed_merge` call
`write_shares` for their own share.
"""

from __future__ import annotations

import ctypes
import multiprocessing as mproc
import os
import queue as queue_mod
import signal
import sys
from collections.abc import Callable

from tqdm import tqdm

import slimckpt.layout.safetensors_layout as layout
from slimckpt.engine import writer_stats
from slimckpt.engine.checkpoint_dir import CheckpointError
from slimckpt.engine.merge_input import open_source
from slimckpt.engine.out_files import OutputError
from slimckpt.hf.plan import ExportPlan
from slimckpt.layout.merge_manifest import CommitError
from slimckpt.log import get_logger
from slimckpt.merge.plan import MergeError, MergeOptions

# lazy imports: torch (the cast) and the torch readers load only when weights are written

log = get_logger("slimckpt.merge")
PR_SET_PDEATHSIG = 1


def die_with_parent(parent: int) -> None:
    """SIGKILL this process when `parent` dies (exit at once if it already has)."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    except (OSError, AttributeError):
        pass  # no prctl: the worker still finishes its writes and exits on its own
    if os.getppid() != parent:  # the parent died before prctl took effect
        os._exit(1)


def write_shares(
    local_dir: str,
    partial: str,
    mp: ExportPlan,
    shares: list[list[layout.Segment]],
    dtype: str,
    chunk_bytes: int,
    progress: Callable[[int], None],
    fsync: bool = True,
    ckpt=None,
    stats: writer_stats.WriterStats | None = None,
) -> dict[str, str]:
    """Write `shares` here, one after the other; returns checksums of files written whole. An opened
    `ckpt` is used (and left open) instead of opening `local_dir`; `stats`, when given, receives
    where the time went."""
    import torch

    from slimckpt.engine.share_writer import OUT_DTYPES, ShareWriter

    owned = ckpt is None
    ckpt = open_source(local_dir) if owned else ckpt
    sources = {new: ckpt.tensors[old] for new, old in mp.name_map.items()}
    lora_sources = {
        n: ckpt.tensors[n] for t in mp.takes.values() if t.delta is not None for n in (t.delta.a, t.delta.b)
    }
    checksums: dict[str, str] = {}
    # One intra-op thread for the casts: the read and write threads already keep the cores busy, and an OpenMP cast whose second thread is not
    # running waits for it (measured: BENCHMARKS.md, Figures quoted in the code).
    # Restored after: an in-training export shares the process.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        for share in shares:
            w = ShareWriter(
                partial,
                mp.plan,
                sources,
                OUT_DTYPES[dtype],
                chunk_bytes,
                progress,
                fsync=fsync,
                takes=mp.takes,
                lora_sources=lora_sources,
                stats=stats,
            )
            w.write_share(share)
            checksums.update(w.checksums)
    finally:
        torch.set_num_threads(threads)
        if owned:
            ckpt.close()
    return checksums


def _worker_entry(args: tuple, queue) -> None:
    local_dir, partial, mp, share, dtype, chunk_bytes, wid, fsync, parent = args
    die_with_parent(parent)  # a killed merge leaves no writer behind (daemon=True acts only on a normal exit)
    pending = [0]  # write_shares casts on one intra-op thread, so N workers share the cores

    def progress(n: int) -> None:
        pending[0] += n
        if pending[0] >= 16 << 20:
            queue.put(("progress", wid, pending[0]))
            pending[0] = 0

    try:
        checksums = write_shares(local_dir, partial, mp, [share], dtype, chunk_bytes, progress, fsync)
        queue.put(("progress", wid, pending[0]))
        queue.put(("done", wid, checksums))
    except BaseException as exc:  # noqa: BLE001 - reported to the parent, which exits nonzero
        queue.put(("error", wid, f"{exc}" if is_user_error(exc) else f"{type(exc).__name__}: {exc}"))


def is_user_error(exc: BaseException) -> bool:
    return isinstance(exc, (CheckpointError, OutputError, CommitError, MergeError))


def run_workers(
    local_dir: str,
    partial: str,
    mp: ExportPlan,
    shares: list[list[layout.Segment]],
    dtype: str,
    chunk_bytes: int,
    progress: Callable[[int], None],
    fsync: bool = True,
    ckpt=None,
    stats: writer_stats.WriterStats | None = None,
) -> dict[str, str]:
    """One spawned process per share (a fresh interpreter: no forked OpenMP or torch threads); one
    share is written here, from `ckpt` when given (and timed into `stats`, when given)."""
    if len(shares) == 1:
        return write_shares(local_dir, partial, mp, shares, dtype, chunk_bytes, progress, fsync, ckpt=ckpt, stats=stats)
    ctx = mproc.get_context("spawn")
    q = ctx.Queue()
    parent = os.getpid()
    procs = [
        ctx.Process(
            target=_worker_entry,
            name=f"slimckpt-merge-{i}",
            daemon=True,
            args=((local_dir, partial, mp, share, dtype, chunk_bytes, i, fsync, parent), q),
        )
        for i, share in enumerate(shares)
    ]
    for p in procs:
        p.start()
    checksums: dict[str, str] = {}
    done: set[int] = set()
    error = None
    try:
        while len(done) < len(procs) and error is None:
            try:
                kind, wid, payload = q.get(timeout=1.0)
            except queue_mod.Empty:
                dead = [
                    i for i, p in enumerate(procs) if i not in done and not p.is_alive() and p.exitcode not in (0, None)
                ]
                if dead:
                    error = f"merge worker {dead[0]} died (exit code {procs[dead[0]].exitcode}); see its output above"
                continue
            if kind == "progress":
                progress(payload)
            elif kind == "done":
                checksums.update(payload)
                done.add(wid)
            else:
                error = payload
    finally:
        if error is not None:
            for p in procs:
                if p.is_alive():
                    p.terminate()
        for p in procs:
            p.join()
    if error is not None:
        raise MergeError(error)
    return checksums


class ProgressBar:
    """tqdm over bytes on stderr, or nothing (--no_progress, in-training exports)."""

    def __init__(self, total: int, enabled: bool, desc: str) -> None:
        self.bar = None
        if enabled:
            self.bar = tqdm(
                total=total,
                unit="B",
                unit_scale=True,
                unit_divisor=1024,
                desc=desc,
                file=sys.stderr,
                dynamic_ncols=True,
            )

    def __call__(self, n: int) -> None:
        if self.bar is not None:
            self.bar.update(n)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def write_weights(opts: MergeOptions, partial: str, mp: ExportPlan, ckpt=None) -> dict[str, str]:
    """Every weight byte of `mp` into the files `create_files` made in `partial`, with --workers
    (an opened `ckpt` is used by a single worker; more open their own)."""
    shares = layout.partition(mp.plan, opts.workers)
    bar = ProgressBar(mp.plan.total_size, opts.progress, "slimckpt merge")
    stats_path = writer_stats.requested_path() if len(shares) == 1 else None
    stats = writer_stats.WriterStats() if stats_path else None
    try:
        checksums = run_workers(
            opts.local_dir, partial, mp, shares, opts.dtype, opts.chunk_bytes, bar, opts.fsync, ckpt=ckpt, stats=stats
        )
    finally:
        bar.close()
    if stats is not None:
        try:
            stats.save(stats_path)
        except OSError as exc:  # a diagnostic: the merge itself succeeded
            log.warning(
                "could not write the writer's timings to %s (%s): %s=%s is ignored",
                stats_path,
                exc.strerror or exc,
                writer_stats.STATS_ENV,
                stats_path,
            )
    return checksums
