"""`slimckpt merge`'s run: the parsed options (slimckpt.merge.cli) into a `MergeOptions`, the merge,
and its one-line error or summary."""

from __future__ import annotations

import argparse
import sys

from slimckpt import env_vars
from slimckpt.engine.pickle_policy import set_trusted
from slimckpt.merge.pipeline import merge
from slimckpt.merge.plan import MergeError, MergeOptions
from slimckpt.merge.remote import is_remote, merge_remote


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
        # before it met the others: distributed.report_together)
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
