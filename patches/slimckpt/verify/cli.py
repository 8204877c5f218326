"""`slimckpt verify ...`: the command's arguments (wired in slimckpt.cli); its run is
slimckpt.verify.command."""

# lazy imports: `slimckpt verify --help` answers before the storage backends and readers load
from __future__ import annotations

import argparse

from slimckpt.cli_flags import flag

HELP = "check a checkpoint dir: manifest, size and checksum of every file; exit 1 naming each bad file"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "dir",
        help="trainer.default_local_dir, a global_step_N dir, a role dir (global_step_N/actor) "
        "or a slimckpt merge output",
    )
    flag(p, "--quick", action="store_true", help="sizes and names only: read no file's contents")
    flag(p, "--json", action="store_true", help="print the report as JSON (for scripts)")
    flag(p, "--no-progress", action="store_true", help="no progress bar")
    flag(
        p,
        "--clean",
        action="store_true",
        help="an s3:// dir: first abort the unfinished multipart uploads a killed save or merge left under it "
        "(they hold space and are invisible to every reader); nothing committed is touched",
    )
    flag(
        p,
        "--trust-pickle",
        action="store_true",
        help="load pickles naming any global (default: a global verl and torch never write is reported "
        "as damage, and not run)",
    )


def run(args: argparse.Namespace) -> int:
    from slimckpt.verify.command import run as verify_command

    return verify_command(args)
