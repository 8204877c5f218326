"""`slimckpt diskspeed DIR`: the command's arguments (wired in slimckpt.cli); the measurement is
slimckpt.observe.diskspeed."""

# lazy imports: `slimckpt diskspeed --help` answers before the measuring modules load
from __future__ import annotations

import argparse

from slimckpt.cli_flags import flag

HELP = "a directory's sequential disk bandwidth: through the page cache, with O_DIRECT, and both at once"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("directory", help="a directory on the filesystem to measure (a scratch file is written there)")
    flag(p, "--size-gb", type=float, default=1.0, help="bytes per round, in GiB (default 1)")
    flag(p, "--repeats", type=int, default=3, help="rounds per path; medians are shown (default 3)")


def run(args: argparse.Namespace) -> int:
    from slimckpt.observe.diskspeed import measure_disk_speed

    print(measure_disk_speed(args.directory, int(args.size_gb * 2**30), args.repeats).describe())
    return 0
