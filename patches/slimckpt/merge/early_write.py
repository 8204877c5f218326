"""The merge's early write: weights written from a guessed plan while the process still imports
torch and transformers for the real one, so the disk works during the imports. `EarlyWrite.start` is
its one entry point; the pipeline keeps the result only if the real plan `matches` the guess.

What it earns is measured by `make bench`: BENCHMARKS.md's row "slimckpt, no early write" is the same
merge with SLIMCKPT_MERGE_GUESS=0 (the outputs are byte-identical either way).
"""

from __future__ import annotations

import os
import sys
import threading

from .. import env_vars
from ..format.merge_manifest import discard_partial, prepare_partial
from ..format.names import HF_SUBDIR
from ..hf.naming import guess_default_max_shard_size
from ..hf.plan import ExportPlan, check_output_room, plan_names
from ..log import get_logger
from ..write import forked_call
from ..write.out_files import create_files
from . import guess as merge_guess
from .plan import MergeOptions
from .workers import ProgressBar, write_weights

# lazy imports: numpy's writer, the `.pt` index or torch's readers load in the path that runs (the point is to start before torch)

log = get_logger("slimckpt.merge")


def _write_weights_without_torch(opts: MergeOptions, partial: str, mp: ExportPlan, sources: dict) -> dict[str, str]:
    from ..write import np_writer, writer_stats

    bar = ProgressBar(mp.plan.total_size, opts.progress, "slimckpt merge")
    stats = writer_stats.WriterStats()
    try:
        checksums = np_writer.write_plan(
            partial, mp.plan, sources, opts.dtype, opts.chunk_bytes, bar, opts.fsync, stats=stats, takes=mp.takes
        )
    finally:
        bar.close()
    stats_path = writer_stats.requested_path()
    if stats_path:
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


def _torch_imported() -> bool:
    return "torch" in sys.modules


class EarlyWrite:
    """Weights written from the guessed plan (slimckpt.merge.guess) and a quick reading of the rank
    files while this process imports torch and transformers for the real ones: the disk works
    during the imports. `matches` decides whether the result counts.

    First choice: a child forked before torch is imported, which reads the rank files with
    `pt_index` and writes with `np_writer` (no torch: it starts 1.3-4 s sooner). Else, once torch
    is imported, the same index's tensors (`sources.open_indexed`) and the torch writer, in a forked child where that is safe
    (`forked_call`), or on a thread. In a thread, the pipeline's read, cast and write threads wait
    for the GIL while the imports run Python: on the 1B merge here its writing took 6.3-7.5 s beside
    the imports, 4.6-5.0 s alone."""

    def __init__(self, target: str, mp: ExportPlan, signature: list[tuple], close=None, local_dir: str = "") -> None:

        self.mp = mp
        self.signature = signature
        self.checksums: dict[str, str] | None = None
        self.error: BaseException | None = None
        self.thread = None
        self.child: forked_call.ForkedCall | None = None
        try:
            check_output_room(local_dir, target, mp)  # a guess names the files the real plan does
        except BaseException:
            if close is not None:
                close()
            raise
        self.partial = prepare_partial(target)
        try:
            create_files(self.partial, mp.plan)
        except BaseException:
            discard_partial(self.partial)
            if close is not None:
                close()
            raise

    def _fork(self, fn, *args) -> bool:
        try:
            self.child = forked_call.ForkedCall(fn, *args, name="merge's writer process")
            return True
        except OSError as exc:  # EAGAIN/ENOMEM from fork
            log.info("could not fork the merge's writer (%s)", exc.strerror or exc)
            return False

    @classmethod
    def start(cls, opts: MergeOptions, target: str) -> EarlyWrite | None:
        """None when there is no safe guess; the normal path then plans first and writes after."""
        if not env_vars.flag("SLIMCKPT_MERGE_GUESS"):
            return None

        config = merge_guess.read_config(os.path.join(opts.local_dir, HF_SUBDIR))
        if config is None:
            return None
        return cls._start_without_torch(opts, target, config) or cls._start_with_torch(opts, target, config)

    @classmethod
    def _start_without_torch(cls, opts: MergeOptions, target: str, config: dict) -> EarlyWrite | None:
        if _torch_imported() or not forked_call.possible():
            return None  # no time to win: torch is here already; or a thread would share the imports' GIL
        from ..read import pt_index
        from ..write import np_writer

        index = pt_index.open_index(opts.local_dir)
        names = (
            merge_guess.guess_output_names(list(index.tensors), config, {n: t.shape for n, t in index.tensors.items()})
            if index is not None
            else None
        )
        if names is None:
            return None
        sources = {new: index.tensors[old] for new, old in names.items()}
        try:
            np_writer.check(sources, opts.dtype)
        except np_writer.Declined as exc:
            log.debug("no early write without torch: %s", exc)
            return None
        mp = plan_names(index, names, opts.dtype, opts.max_shard_size or guess_default_max_shard_size(), 0)
        early = cls(target, mp, pt_index.signature(index, names), local_dir=opts.local_dir)
        if not early._fork(_write_weights_without_torch, opts, early.partial, mp, sources):
            discard_partial(early.partial)
            return None
        log.debug("early write: a child forked before torch is imported writes the weights")
        return early

    @classmethod
    def _start_with_torch(cls, opts: MergeOptions, target: str, config: dict) -> EarlyWrite | None:
        from ..read.merge_input import open_source
        from ..read.sources import CheckpointError, open_indexed, signature

        ckpt = open_indexed(opts.local_dir)  # no torch.distributed import (measured: BENCHMARKS.md)
        if ckpt is None:
            try:
                ckpt = open_source(opts.local_dir)
            except CheckpointError:
                return None  # the normal path reports it
        names = merge_guess.guess_output_names(
            list(ckpt.tensors), config, {n: tuple(t.shape) for n, t in ckpt.tensors.items()}
        )
        if names is None:
            ckpt.close()
            return None
        mp = plan_names(ckpt, names, opts.dtype, opts.max_shard_size or guess_default_max_shard_size(), 0)
        early = cls(target, mp, signature(ckpt, names), close=ckpt.close, local_dir=opts.local_dir)
        if forked_call.possible() and early._fork(write_weights, opts, early.partial, mp, ckpt):
            log.debug("early write: a child forked after torch is imported writes the weights")
            ckpt.close()  # the child keeps its own mappings of the rank files
        else:  # a thread does the same work
            log.debug("early write: a thread writes the weights")
            early.thread = threading.Thread(
                target=early._run, args=(opts, ckpt), name="slimckpt-early-write", daemon=True
            )
            early.thread.start()
        return early

    def _run(self, opts: MergeOptions, ckpt) -> None:
        try:
            self.checksums = write_weights(opts, self.partial, self.mp, ckpt)
        except BaseException as exc:  # noqa: BLE001 - raised in the caller by join()
            self.error = exc
        finally:
            ckpt.close()

    def matches(self, mp: ExportPlan, signature: list[tuple]) -> bool:
        """Whether the early write wrote what the real plan, from the real reader, would."""
        return (
            mp.plan == self.mp.plan
            and list(mp.takes.items()) == list(self.mp.takes.items())
            and signature == self.signature
        )

    def join(self) -> dict[str, str]:
        if self.child is not None:
            return self.child.join() or {}
        self.thread.join()
        if self.error is not None:
            raise self.error
        return self.checksums or {}

    def cancel(self) -> None:
        if self.child is not None:
            self.child.kill()
        else:
            self.thread.join()  # a thread has no stop switch; a wrong guess costs one write, not correctness
        discard_partial(self.partial)
