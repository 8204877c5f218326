"""`slimckpt convert <step dir> --to verl --world-size M`'s run (its arguments are slimckpt.convert.cli):
a committed step written as verl 0.9.1's own rank files at M ranks (model, optimizer, extra state),
plus verl's tracker, so that verl without slimckpt resumes it (`trainer.default_local_dir=<target>`, resume_mode=auto).

Reads slimckpt's incremental dcp/ steps and verl's own FSDP2 rank files at any N. Each rank's
files are written one tensor at a time from the memory-mapped source (rank_file), into
`<target>/global_step_N.partial`, renamed to `global_step_N` once every file is fsynced; only then
does the tracker move. A convert that is killed leaves a `.partial` dir that verl never looks at.
"""

# lazy imports: torch-free until a conversion runs (the plan, a remote step's mirror); torch and the rank files then
from __future__ import annotations

import argparse
import os
import sys

from slimckpt.convert.plan import ConvertError
from slimckpt.convert.remote import mirror_step
from slimckpt.engine.checkpoint_dir import CheckpointError
from slimckpt.engine.pickle_policy import set_trusted
from slimckpt.storage import for_path, is_url


def run(args: argparse.Namespace) -> int:
    set_trusted(args.trust_pickle)
    step_dir, scratch = args.step_dir, None
    try:
        if is_url(args.step_dir):
            if not args.target_dir or is_url(args.target_dir):
                raise ConvertError(
                    f"{args.step_dir}: a step on object storage is converted into a local checkpoint root; "
                    f"pass --target-dir <local dir> (the resuming job's trainer.default_local_dir)"
                )
            scratch, step_dir = mirror_step(
                args.step_dir, args.target_dir, not args.no_progress and sys.stderr.isatty()
            )
        from slimckpt.convert.write import convert

        target, summary = convert(
            step_dir,
            args.world_size,
            args.fsdp,
            args.target_dir,
            args.overwrite,
            progress=not args.no_progress and sys.stderr.isatty(),
        )
    except (ConvertError, CheckpointError) as exc:
        line = str(exc).removeprefix("slimckpt: ")
        if scratch is not None:
            line = line.replace(os.path.dirname(step_dir), os.path.dirname(args.step_dir.rstrip("/")))
        sys.stderr.write(f"slimckpt convert: error: {line}\n")
        sys.stderr.flush()
        return 1
    finally:
        if scratch is not None:
            for_path(scratch).remove_tree(scratch, ignore_errors=True)
    print(summary)
    return 0
