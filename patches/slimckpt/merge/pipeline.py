"""Streaming merge of a verl FSDP checkpoint into a Hugging Face model dir: plan -> write -> commit.

verl's `python -m verl.model_merger merge --backend fsdp` loads every rank's .pt, casts to bf16,
`torch.cat`s each tensor and `save_pretrained`s: every shard and the whole model in RAM at once
(measured: BENCHMARKS.md's merge table). Here the rank
files are memory-mapped, the safetensors layout is planned up front (`layout`), and each shard's
rows are cast in bounded chunks and written straight to their final offset (`write.share_writer`), by one or
more processes (`--workers`, or ranks of `torchrun ... --distributed_merge`). The directory is
committed atomically with a manifest (`format.merge_manifest`). What is planned is in `plan`; the
command is `cli`, verl's redirected merger `verl_merger`. The steps a merge takes alike in one process
and on torchrun ranks are `steps`, the ranks' merge `distributed`, verl's merger as the fallback
`verl_fallback`.

The output equals verl's tensor for tensor: names (tied embeddings dropped by verl's own
`drop_tied_target_keys`, `_keys_to_ignore_on_save`, transformers' save-time renamings), dtypes
(bf16 unless --dtype), shapes and values (the same torch cast). config.json and
generation_config.json are written by the same transformers calls save_pretrained makes, the
tokenizer/processor by verl's loaders; a single-file output is byte-identical to verl's.
Differences: no tokenizer is a warning (verl exits 1 after writing); a multi-file split follows
the checkpoint's key order (verl iterates a Python set, so its split varies run to run).
An output that transformers' save splits off a fused tensor (transformers 5 stores an MoE layer's
experts as one `[E, 2I, H]` tensor and saves them per expert) is planned as the run of the source's
elements it is (`hf.naming.HfSide.output_sources`, `layout.Take`) and streamed like any other.
A LoRA checkpoint is planned by `hf.lora.plan_lora` (the base model with peft's names undone plus
`lora_adapter/`, or with `--merge_lora` the adapter merged into the base weights) and streamed the
same way. Models whose save makes tensors that are not one run of one checkpoint
tensor (a transpose, a concatenation) go to verl's own merger, with a log line saying so and the
host memory it takes (`verl_merger_memory`); `MergeOptions.verl_fallback=False` refuses them
instead. Under torchrun (and in the intermediate tier's export) verl's merger runs on rank 0 and
its failure is raised on every rank.
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Callable

import slimckpt.layout.safetensors_layout as layout
from slimckpt.engine.checkpoint_dir import CheckpointError
from slimckpt.engine.merge_input import check_source
from slimckpt.engine.out_files import OutputError
from slimckpt.engine.output_dir import discard_partial, prepare_partial
from slimckpt.hf.lay_out import lay_out
from slimckpt.hf.naming import HfSide
from slimckpt.hf.plan import ExportPlan, check_output_room
from slimckpt.layout.merge_manifest import CommitError, check_target
from slimckpt.layout.names import DTYPE_CHOICES
from slimckpt.log import get_logger
from slimckpt.merge.distributed import merge_distributed
from slimckpt.merge.plan import MergeError, MergeOptions, MergeResult
from slimckpt.merge.steps import (
    finish,
    log_committed,
    log_start,
    message,
    open_and_plan,
    resolve_max_shard_size,
    source_lock,
    target_lock,
)
from slimckpt.merge.verl_fallback import run_verl_merger
from slimckpt.merge.workers import write_weights
from slimckpt.storage import in_flight
from slimckpt.storage.locks import LockBusy

log = get_logger("slimckpt.merge")


def _ignore_sigxfsz() -> None:
    # past RLIMIT_FSIZE the kernel sends SIGXFSZ, which kills by default; EFBIG is reported instead
    try:
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    except (ValueError, AttributeError):  # not the main thread, or no such signal
        pass


# ------------------------------------------------------------------------------------------------
# Entry points
# ------------------------------------------------------------------------------------------------
def merge(opts: MergeOptions, verl_fallback: Callable[[], None] | None = None) -> MergeResult:
    """Merge `opts.local_dir` into `opts.target_dir`; raises MergeError with a one-line message.
    Called in a training job, it first waits for the commit of that job's save of the step, if
    one is in flight."""
    in_flight.wait_for(opts.local_dir)

    if opts.dtype not in DTYPE_CHOICES:
        raise MergeError(f"--dtype {opts.dtype!r}: choose one of {', '.join(DTYPE_CHOICES)}")
    if opts.workers < 1:
        raise MergeError(f"--workers {opts.workers}: use 1 or more")
    if opts.max_shard_size is not None:
        try:
            layout.parse_size(opts.max_shard_size)
        except layout.LayoutError as exc:
            raise MergeError(f"--max_shard_size: {exc}") from None
    _ignore_sigxfsz()
    try:
        if opts.distributed:
            return merge_distributed(opts, verl_fallback)
        with source_lock(opts), target_lock(opts):
            return _merge_local(opts, verl_fallback)
    except (CommitError, layout.LayoutError, LockBusy) as exc:
        raise MergeError(message(exc, opts.os_fixes)) from None
    except Exception as exc:
        if _is_input_or_output_error(exc):
            raise MergeError(message(exc, opts.os_fixes)) from None
        raise


def _is_input_or_output_error(exc: BaseException) -> bool:
    return isinstance(exc, (CheckpointError, OutputError))


def _merge_local(opts: MergeOptions, verl_fallback: Callable[[], None] | None) -> MergeResult:
    t0 = time.perf_counter()
    target = os.path.abspath(opts.target_dir)
    check_target(target, opts.overwrite, opts.overwrite_hint)
    # before any import: a wrong --local_dir fails in milliseconds, not after torch and transformers
    check_source(opts.local_dir, checksums=not opts.source_checked)

    resolve_max_shard_size(opts)
    planned = open_and_plan(opts)
    if planned is None:
        return run_verl_merger(opts, verl_fallback, t0)
    return _write_and_commit(opts, *planned, t0)


def _write_and_commit(opts: MergeOptions, mp: ExportPlan, hf: HfSide, t0: float) -> MergeResult:
    target = os.path.abspath(opts.target_dir)
    log_start(opts, target, mp)
    check_output_room(opts.local_dir, target, mp)
    partial = prepare_partial(target)
    ok = False
    try:
        tokenizer_saved = lay_out(partial, mp, hf)
        checksums = write_weights(opts, partial, mp)
        files = finish(partial, target, mp, checksums, opts, tokenizer_saved)
        ok = True
    finally:
        if not ok:
            discard_partial(partial)
    seconds = time.perf_counter() - t0
    log_committed(target, seconds)
    return MergeResult(target, files, mp.weight_bytes, seconds, False, tokenizer_saved)
