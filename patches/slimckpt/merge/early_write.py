"""The merge's early write: weights written from a guessed plan while the process still imports
transformers and verl for the real one, so the disk works during the imports. `EarlyWrite.start` is
its one entry point; the pipeline keeps the result only if the real plan `matches` the guess.

What it earns is measured by `make bench`: BENCHMARKS.md's row "slimckpt, no early write" is the same
merge with SLIMCKPT_MERGE_GUESS=0 (the outputs are byte-identical either way).
"""

from __future__ import annotations

import os
import threading

from .. import env_vars
from ..format.merge_manifest import discard_partial, prepare_partial
from ..format.names import HF_SUBDIR
from ..hf.naming import guess_default_max_shard_size
from ..hf.plan import ExportPlan, check_output_room, plan_names
from ..log import get_logger
from ..write.out_files import create_files
from . import guess as merge_guess
from .plan import MergeOptions
from .workers import write_weights

# lazy imports: the rank files' readers load (with torch) once a guess is there to write from

log = get_logger("slimckpt.merge")


class EarlyWrite:
    """Weights written from the guessed plan (slimckpt.merge.guess) and a quick reading of the rank
    files (`sources.open_indexed`: no torch.distributed import) on a thread, while this process
    imports transformers and verl for the real plan: the disk works during the imports.
    `matches` decides whether the result counts. The pipeline's read, cast and write threads
    release the GIL for their I/O and casts, and the merge shortens the GIL's switch interval
    (pipeline._quick_gil_handoff), so the imports slow it little."""

    def __init__(self, target: str, mp: ExportPlan, signature: list[tuple], close=None, local_dir: str = "") -> None:
        self.mp = mp
        self.signature = signature
        self.checksums: dict[str, str] | None = None
        self.error: BaseException | None = None
        self.thread: threading.Thread | None = None
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

    @classmethod
    def start(cls, opts: MergeOptions, target: str) -> EarlyWrite | None:
        """None when there is no safe guess; the normal path then plans first and writes after."""
        if not env_vars.flag("SLIMCKPT_MERGE_GUESS"):
            return None

        config = merge_guess.read_config(os.path.join(opts.local_dir, HF_SUBDIR))
        if config is None:
            return None
        return cls._start(opts, target, config)

    @classmethod
    def _start(cls, opts: MergeOptions, target: str, config: dict) -> EarlyWrite | None:
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
        log.debug("early write: a thread writes the weights")
        early.thread = threading.Thread(target=early._run, args=(opts, ckpt), name="slimckpt-early-write", daemon=True)
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
        self.thread.join()
        if self.error is not None:
            raise self.error
        return self.checksums or {}

    def cancel(self) -> None:
        self.thread.join()  # a thread has no stop switch; a wrong guess costs one write, not correctness
        discard_partial(self.partial)
