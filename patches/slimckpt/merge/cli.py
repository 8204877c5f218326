"""`slimckpt merge ...`: the command's arguments and its run (wired in slimckpt.cli)."""

from __future__ import annotations

import argparse
import sys

from slimckpt import env_vars
from slimckpt.engine.pickle_policy import set_trusted
from slimckpt.layout.names import DEFAULT_CHUNK_BYTES, DTYPE_CHOICES
from slimckpt.merge.pipeline import merge
from slimckpt.merge.plan import MergeError, MergeOptions
from slimckpt.merge.remote import is_remote, merge_remote

DEFAULT_CHUNK_MB = DEFAULT_CHUNK_BYTES >> 20

# lazy imports: `slimckpt merge --help` and the argument errors come before the pipeline is imported

HELP = "merge a verl FSDP checkpoint into a Hugging Face model dir, streaming (bounded memory)"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--local_dir",
        required=True,
        help="verl checkpoint dir holding model_world_size_*_rank_*.pt (…/global_step_N/actor), or an "
        "incremental step's role dir, local or s3://bucket/prefix/global_step_N/actor",
    )
    p.add_argument(
        "--target_dir",
        required=True,
        help="output dir, local or s3://bucket/prefix; must not exist, be empty, or --overwrite",
    )
    p.add_argument(
        "--scratch_dir",
        default=None,
        help="where an s3:// source's model records (and an s3:// target's output) are staged on local "
        "disk (default: next to a local --target_dir, else $TMPDIR); removed when the merge ends",
    )
    p.add_argument(
        "--dtype", choices=list(DTYPE_CHOICES), default="bf16", help="output dtype (verl's merger always writes bf16)"
    )
    p.add_argument(
        "--max_shard_size",
        default=None,
        help="split weights into files of at most this size, e.g. 5GB (default: transformers' "
        "save_pretrained default, 50GB in transformers 5, as verl's merger gets)",
    )
    p.add_argument("--workers", type=int, default=1, help="writer processes on this node (default 1)")
    p.add_argument(
        "--distributed_merge",
        action="store_true",
        help="run as one of the ranks started by torchrun (one node or many sharing a filesystem)",
    )
    p.add_argument("--overwrite", action="store_true", help="replace a non-empty --target_dir")
    p.add_argument(
        "--trust-remote-code",
        "--trust_remote_code",
        dest="trust_remote_code",
        action="store_true",
        help="allow custom model code from the checkpoint's huggingface/ dir",
    )
    p.add_argument(
        "--trust-pickle",
        "--trust_pickle",
        dest="trust_pickle",
        action="store_true",
        help="unpickle any global the rank files name, as torch.load(weights_only=False) does (default: "
        "only what verl and torch write: tensors, DTensor/ShardedTensor metadata, containers; any "
        "other is refused before it runs); only for files from someone you trust",
    )
    p.add_argument(
        "--chunk_mb",
        type=int,
        default=DEFAULT_CHUNK_MB,
        help=f"MiB of source read, cast and written as one piece; a writer holds about three "
        f"(default {DEFAULT_CHUNK_MB})",
    )
    p.add_argument(
        "--no_fsync",
        action="store_true",
        help="skip fsync of the weight files: faster on slow disks, but after a power loss (not a "
        "process crash) a committed output may hold torn files (`slimckpt verify` detects them)",
    )
    p.add_argument("--no_progress", action="store_true", help="no progress bar")
    p.add_argument(
        "--merge_lora",
        action="store_true",
        help="a LoRA checkpoint: write W + (B @ A) * lora_alpha / r into the base weights, as peft's "
        "merge_and_unload() does (alpha and r from lora_train_meta.json), and no lora_adapter/ "
        "(default: the base model plus lora_adapter/, as verl's merger writes them)",
    )
    p.add_argument(
        "--no_verl_fallback",
        action="store_true",
        help="refuse, in one line, a checkpoint the streaming merge does not handle (a save-time "
        "conversion that is not a slice of one tensor) instead of running verl's own merger on it, "
        "which holds the whole model in host memory (the line says how much)",
    )


def run(args: argparse.Namespace) -> int:

    set_trusted(args.trust_pickle)  # an environment variable: the writer processes it starts trust too
    opts = MergeOptions(
        local_dir=args.local_dir,
        target_dir=args.target_dir,
        dtype=args.dtype,
        max_shard_size=args.max_shard_size,
        workers=args.workers,
        distributed=args.distributed_merge,
        overwrite=args.overwrite,
        trust_remote_code=args.trust_remote_code,
        progress=not args.no_progress,
        chunk_bytes=max(1, args.chunk_mb) << 20,
        fsync=not args.no_fsync,
        verl_fallback=not args.no_verl_fallback,
        merge_lora=args.merge_lora,
    )

    try:
        result = merge_remote(opts, merge, args.scratch_dir) if is_remote(opts) else merge(opts)
    except MergeError as exc:
        # one write: print() writes the line and its newline apart, and the ranks of a distributed
        # merge, sharing one stderr, then interleave their lines (a distributed rank wrote it already,
        # before it met the others: pipeline.report_together)
        if not getattr(exc, "reported", False):
            sys.stderr.write(f"slimckpt merge: error: {exc}\n")
            sys.stderr.flush()
        return 1
    if not opts.distributed or env_vars.foreign("RANK", "0") == "0":
        print(
            f"merged into {result.target_dir} ({result.weight_bytes / 1e9:.2f} GB weights, "
            f"{result.seconds:.1f} s)" + (" by verl's merger" if result.used_verl_merger else "")
        )
    return 0
