"""`slimckpt merge ...`: the command's arguments (wired in slimckpt.cli); its run is
slimckpt.merge.command."""

# lazy imports: `slimckpt merge --help` and the argument errors answer before the pipeline (and torch) is imported
from __future__ import annotations

import argparse

from slimckpt.cli_flags import flag
from slimckpt.layout.names import DEFAULT_CHUNK_BYTES, DTYPE_CHOICES

DEFAULT_CHUNK_MB = DEFAULT_CHUNK_BYTES >> 20

HELP = "merge a verl FSDP checkpoint into a Hugging Face model dir, streaming (bounded memory)"


def add_arguments(p: argparse.ArgumentParser) -> None:
    flag(
        p,
        "--local-dir",
        required=True,
        help="verl checkpoint dir holding model_world_size_*_rank_*.pt (…/global_step_N/actor), or an "
        "incremental step's role dir, local or s3://bucket/prefix/global_step_N/actor",
    )
    flag(
        p,
        "--target-dir",
        required=True,
        help="output dir, local or s3://bucket/prefix; must not exist, be empty, or --overwrite",
    )
    flag(
        p,
        "--scratch-dir",
        default=None,
        help="where an s3:// source's model records (and an s3:// target's output) are staged on local "
        "disk (default: next to a local --target-dir, else $TMPDIR); removed when the merge ends",
    )
    flag(
        p,
        "--dtype",
        choices=list(DTYPE_CHOICES),
        default="bf16",
        help="output dtype (verl's merger always writes bf16)",
    )
    flag(
        p,
        "--max-shard-size",
        default=None,
        help="split weights into files of at most this size, e.g. 5GB (default: transformers' "
        "save_pretrained default, 50GB in transformers 5, as verl's merger gets)",
    )
    flag(p, "--workers", type=int, default=1, help="writer processes on this node (default 1)")
    flag(
        p,
        "--distributed-merge",
        action="store_true",
        help="run as one of the ranks started by torchrun (one node or many sharing a filesystem)",
    )
    flag(p, "--overwrite", action="store_true", help="replace a non-empty --target-dir")
    flag(
        p,
        "--trust-remote-code",
        action="store_true",
        help="allow custom model code from the checkpoint's huggingface/ dir",
    )
    flag(
        p,
        "--trust-pickle",
        action="store_true",
        help="unpickle any global the rank files name, as torch.load(weights_only=False) does (default: "
        "only what verl and torch write: tensors, DTensor/ShardedTensor metadata, containers; any "
        "other is refused before it runs); only for files from someone you trust",
    )
    flag(
        p,
        "--chunk-mb",
        type=int,
        default=DEFAULT_CHUNK_MB,
        help=f"MiB of source read, cast and written as one piece; a writer holds about three "
        f"(default {DEFAULT_CHUNK_MB})",
    )
    flag(
        p,
        "--no-fsync",
        action="store_true",
        help="skip fsync of the weight files: faster on slow disks, but after a power loss (not a "
        "process crash) a committed output may hold torn files (`slimckpt verify` detects them)",
    )
    flag(p, "--no-progress", action="store_true", help="no progress bar")
    flag(
        p,
        "--merge-lora",
        action="store_true",
        help="a LoRA checkpoint: write W + (B @ A) * lora_alpha / r into the base weights, as peft's "
        "merge_and_unload() does (alpha and r from lora_train_meta.json), and no lora_adapter/ "
        "(default: the base model plus lora_adapter/, as verl's merger writes them)",
    )
    flag(
        p,
        "--no-verl-fallback",
        action="store_true",
        help="refuse, in one line, a checkpoint the streaming merge does not handle (a save-time "
        "conversion that is not a slice of one tensor) instead of running verl's own merger on it, "
        "which holds the whole model in host memory (the line says how much)",
    )


def run(args: argparse.Namespace) -> int:
    from slimckpt.merge.command import run as merge_command

    return merge_command(args)
