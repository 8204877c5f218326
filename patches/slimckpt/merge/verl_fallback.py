"""verl's own merger for a checkpoint the streaming merge cannot reproduce: whether it may run (verl's
FSDPModelMerger reads verl's rank files only, and not where it would read rank 0's file alone), the host
memory it takes, said in the log line or in the refusal (`MergeOptions.verl_fallback=False`), and the
run, its failure reported in one line."""

from __future__ import annotations

import contextlib
import math
import os
import time
from collections.abc import Callable

from slimckpt.layout.names import HF_SUBDIR
from slimckpt.log import get_logger
from slimckpt.merge.plan import MergeError, MergeOptions, MergeResult
from slimckpt.verl_files.in_process_merger import verl_merger_call

# lazy imports: torch loads only where a merge needs it (a bad input fails first)

log = get_logger("slimckpt.merge")


def verl_merger_memory(ckpt) -> tuple[int, int, int]:
    """(bytes, shard bytes, parameters): host memory verl 0.9.1's FSDPModelMerger takes for this
    checkpoint, estimated as the rank model files it loads whole (`torch.load` of every
    `model_world_size_W_rank_r.pt`: the fp32 shards, S bytes) plus the whole model in bf16 (2 bytes
    a parameter: the merged tensors it hands to save_pretrained). For fp32 shards that is 1.5 S,
    what README's table measured (1.5-1.7x the shards at 0.25-1B)."""
    shard_bytes = 0
    for rank in range(ckpt.world_size):
        with contextlib.suppress(OSError):
            shard_bytes += os.path.getsize(ckpt.model_file(rank))
    params = sum(math.prod(t.shape) for t in ckpt.tensors.values())
    return shard_bytes + 2 * params, shard_bytes, params


def human_bytes(n: float) -> str:
    for unit, size in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= size:
            return f"{n / size:.2f} {unit}"
    return f"{int(n)} B"


def log_fallback(opts: MergeOptions, why: str, ckpt) -> None:
    if ckpt.source_format != "verl_fsdp":  # verl's merger reads verl's rank files only
        raise MergeError(
            f"slimckpt's streaming merge does not handle this checkpoint ({why}), and verl's own "
            f"FSDPModelMerger reads verl's rank files, not dcp/: resume from this step with "
            f"+recipe=intermediate, whose saves verl's merger reads, and merge that save"
        )
    from slimckpt.engine.verl_sources import verl_reads_rank0_alone

    first = verl_reads_rank0_alone(ckpt)
    if first is not None:
        raise MergeError(
            f"slimckpt's streaming merge does not handle this checkpoint ({why}), and verl's own "
            f"FSDPModelMerger would write it wrong: it takes the device mesh from the first key, {first!r}, "
            f"which is not sharded, so it reads {ckpt.model_file(0)} alone and writes rank 0's rows of "
            f"every sharded tensor; not run"
        )
    total, shards, params = verl_merger_memory(ckpt)
    memory = (
        f"about {human_bytes(total)} of host memory (the {human_bytes(shards)} of rank model files, read "
        f"whole, + {params:,} parameters x 2 bytes in bf16)"
    )
    if not opts.verl_fallback:
        raise MergeError(
            f"slimckpt's streaming merge does not handle this checkpoint ({why}), and verl's own "
            f"FSDPModelMerger, which would, holds the whole model: {memory}; not run, as "
            f"{opts.verl_fallback_hint} asks"
        )
    log.warning(
        "slimckpt streaming merge does not handle this checkpoint: %s; running verl's own "
        "FSDPModelMerger instead (not atomic), which takes %s; %s refuses instead",
        why,
        memory,
        opts.verl_fallback_hint,
    )
    if opts.dtype != "bf16":
        raise MergeError(
            f"--dtype {opts.dtype}: verl's merger, which this checkpoint needs, only writes bf16; drop --dtype"
        )


def run_verl_merger(opts: MergeOptions, verl_fallback: Callable[[], None] | None, t0: float) -> MergeResult:
    if verl_fallback is None:
        verl_fallback = verl_merger_call(
            opts.local_dir, opts.target_dir, os.path.join(opts.local_dir, HF_SUBDIR), opts.trust_remote_code
        )
    try:
        verl_fallback()
    except Exception as exc:  # noqa: BLE001 - verl's own failure, reported on one line
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        raise MergeError(
            f"verl's FSDPModelMerger (which this checkpoint needs) failed: {type(exc).__name__}: {first}"
        ) from exc
    return MergeResult(os.path.abspath(opts.target_dir), used_verl_merger=True, seconds=time.perf_counter() - t0)
