"""`slimckpt convert ...`: the command's arguments (wired in slimckpt.cli); its run is
slimckpt.convert.command."""

# lazy imports: `slimckpt convert --help` and the argument errors answer before the conversion's modules load
from __future__ import annotations

import argparse

from slimckpt.cli_flags import flag

HELP = "write a step (slimckpt's dcp/ or verl's rank files, at any world size) as verl's rank files at M ranks"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("step_dir", help="<trainer.default_local_dir>/global_step_N (its actor/ and critic/ are converted)")
    flag(p, "--to", choices=["verl"], required=True, help="the format written: verl 0.9.1's rank files")
    flag(p, "--world-size", type=int, required=True, help="ranks (GPUs) of the job that resumes it")
    flag(
        p,
        "--fsdp",
        type=int,
        choices=[1, 2],
        default=None,
        help="verl's actor.strategy: 2 for fsdp2 (default: the step's own)",
    )
    flag(
        p,
        "--target-dir",
        default=None,
        help="checkpoint root written (the resuming job's trainer.default_local_dir); "
        "default: <source root>_verl_ws<M>",
    )
    flag(p, "--overwrite", action="store_true", help="replace the target's global_step_N if it exists")
    flag(p, "--no-progress", action="store_true", help="no progress bar")
    flag(
        p,
        "--trust-pickle",
        action="store_true",
        help="unpickle any global the step's files name, as torch.load(weights_only=False) does (default: "
        "only what verl and torch write; any other is refused before it runs); only for files from "
        "someone you trust",
    )


def run(args: argparse.Namespace) -> int:
    from slimckpt.convert.command import run as convert_command

    return convert_command(args)
