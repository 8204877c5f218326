"""`slimckpt dryrun [--plan] <hydra overrides...>`: the command's options, verl's dry run's
(slimckpt.verl.dryrun_args) and the plan's (wired in slimckpt.cli, which hands it every argument
after its name); its run is slimckpt.plan.dryrun."""

# lazy imports: `slimckpt dryrun --help` and an option error answer before Hydra, verl and the cost model load
from __future__ import annotations

import argparse

from slimckpt.cli_flags import flag
from slimckpt.plan.assumed import DEFAULT_COPY_GBPS, DEFAULT_DISK_GBPS, DEFAULT_ROLLOUT_S
from slimckpt.verl.dryrun_args import build_parser as dryrun_parser
from slimckpt.verl.dryrun_args import parse

HELP = (
    "compose verl's PPO config as main_ppo would, print and validate it (no Ray, no GPU); --plan: what its saves cost"
)


def add_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("plan (with --plan: what a save will cost, from the composed config)")
    flag(
        g,
        "--plan",
        action="store_true",
        help="after validation, print slimckpt plan for this configuration's checkpoint saves",
    )
    flag(
        g,
        "--disk-gbps",
        type=float,
        default=DEFAULT_DISK_GBPS,
        help="aggregate write bandwidth of the checkpoint storage, GB/s (assumed: %(default)s)",
    )
    flag(
        g,
        "--rollout-s",
        type=float,
        default=DEFAULT_ROLLOUT_S,
        help="seconds from a save to the next optimizer step (rollout, reward, ref passes; assumed: %(default)s)",
    )
    flag(
        g,
        "--copy-gbps",
        type=float,
        default=DEFAULT_COPY_GBPS,
        help="device-to-host copy bandwidth per rank, GB/s (assumed: %(default)s)",
    )
    flag(
        g,
        "--node-memory-gb",
        type=float,
        default=None,
        help="host memory of one training node, GiB (default: this machine's)",
    )


def build_parser() -> argparse.ArgumentParser:
    parser = dryrun_parser()
    add_arguments(parser)
    return parser


def main(argv: list[str] | None = None) -> int:
    """The command: verl's dry run with the plan's options, then the plan once the config passed."""
    args, overrides = parse(build_parser(), argv)
    from slimckpt.plan.dryrun import run_parsed

    return run_parsed(args, overrides)
