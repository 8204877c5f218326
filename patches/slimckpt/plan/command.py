"""`slimckpt plan`: what a checkpoint will cost, per rank, before a GPU is allocated.

    slimckpt plan --config path/to/config.json --world-size 64 [--recipe incremental] [--disk-gbps 2]
                  [--max-actor-ckpt-to-keep 2] [--max-critic-ckpt-to-keep 2 --critic]
                  [--storage s3 [--upload-gbps 10] [--s3-part-mb 32] [--s3-concurrency 4]]
    python -m slimckpt.plan ...   (the same)

From the model config alone (a meta-device model: shapes, no weights) it prints, for verl's
default save, verl's save with `hf_model`, and each slimckpt recipe: the bytes each rank writes
(fp32 model shard, AdamW's two fp32 moments, extra state), the host memory a rank needs for the
save, the time at the given aggregate disk bandwidth, and how long training is blocked; then the
peak disk under retention and the Hugging Face export's file layout. With a recipe's
keep_optimizer_last / keep_best (`--set keep_optimizer_last=1 --set keep_best=2`) a second table
splits the steps held into whole ones and ones without their optimizer state, next to the same
retention with the optimizer in every kept step and with keep_optimizer_last=1. `--critic` counts
a PPO critic's checkpoints; `--lora-rank R` (with verl's lora_alpha / target_modules /
exclude_modules / target_parameters keys) plans a LoRA actor. `--storage s3` adds, per row that can
save to an s3:// bucket (the incremental tier's), the bytes uploaded, the time until the step is
committed at `--upload-gbps` and the upload's host memory, and the same for `slimckpt merge` of the
HF model to s3://.

The arguments are in slimckpt.plan.cli, the arithmetic in slimckpt.plan.cost (slimckpt.plan.upload
for an object store), the model in slimckpt.plan.meta_model, the report in slimckpt.plan.build, the
tables in slimckpt.plan.printers.
"""

from __future__ import annotations

import argparse
import json
import sys

from slimckpt.plan.build import build_report
from slimckpt.plan.printers import print_report


def run(args: argparse.Namespace) -> int:
    try:
        report = build_report(args)
    except (FileNotFoundError, ValueError, OSError) as exc:
        if str(exc).startswith("slimckpt plan:"):
            print(str(exc).splitlines()[0], file=sys.stderr)
            return 2
        print(_cannot_plan(args, exc), file=sys.stderr)
        return 2
    except Exception as exc:  # noqa: BLE001 - any config it cannot plan: one line, never a traceback
        print(_cannot_plan(args, exc), file=sys.stderr)
        return 2
    if args.json:
        json.dump(report, sys.stdout, indent=1)
        print()
    else:
        print_report(report)
    return 0


def _cannot_plan(args: argparse.Namespace, exc: BaseException) -> str:
    """One line for a config this command cannot plan: what failed, first line only."""
    first = (str(exc).strip().splitlines() or [""])[0][:300]
    return f"slimckpt plan: cannot plan {args.config}: {type(exc).__name__}: {first}".rstrip(": ")
