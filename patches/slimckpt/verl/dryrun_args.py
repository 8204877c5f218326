"""The dry run's own options (`slimckpt dryrun`; slimckpt.plan.dryrun_cli adds the plan's), apart
from the checks so that `--help` and an option error answer before Hydra, OmegaConf or verl load.
Every argument that is not one of these options is a Hydra override."""

from __future__ import annotations

import argparse

from slimckpt.cli_flags import RawFormatter, flag

# verl's trainer module and config name, as in verl/trainer/main_ppo.py's @hydra.main
CONFIG_MODULE = "verl.trainer.config"
DEFAULT_CONFIG_NAME = "ppo_trainer"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="slimckpt dryrun",
        description=(
            "Compose verl's PPO config as `python -m verl.trainer.main_ppo` would, print it and validate it "
            "against verl's config dataclasses. No Ray, no GPU, no model weights. Every argument that is not an "
            "option below is a Hydra override, exactly as you would pass it to main_ppo."
        ),
        epilog=(
            "examples:\n"
            "  slimckpt dryrun +recipe=quickstart +size=70b +cluster=4x8 +algo=ppo\n"
            "  slimckpt dryrun --show actor_rollout_ref.actor.checkpoint,trainer.save_freq "
            "+recipe=quickstart +size=7b\n"
            "  bash scripts/train_70b.sh --dry-run +recipe=quickstart   (the launcher calls this)\n"
            "exit status: 0 config OK, 1 verl would reject the config, 2 Hydra could not compose it"
        ),
        formatter_class=RawFormatter,
    )
    flag(parser, "--config-name", "-cn", default=DEFAULT_CONFIG_NAME, help="verl config name (default: %(default)s)")
    flag(
        parser,
        "--show",
        metavar="KEYS",
        help="print only these dotted keys (comma-separated), e.g. actor_rollout_ref.actor.checkpoint,trainer",
    )
    flag(parser, "--no-print", action="store_true", help="validate only; print no config")
    flag(parser, "--unresolved", action="store_true", help="print ${...} interpolations as written")
    flag(parser, "--no-validate", action="store_true", help="compose and print only")
    flag(parser, "--verbose", "-v", action="store_true", help="list every check and verl's own messages")
    return parser


def parse(parser: argparse.ArgumentParser, argv: list[str] | None) -> tuple[argparse.Namespace, list[str]]:
    """The options, and the Hydra overrides (every other argument); an unknown `-x` is an error."""
    args, overrides = parser.parse_known_args(argv)
    stray = [a for a in overrides if a.startswith("-")]
    if stray:
        parser.error(f"unknown option {stray[0]} (Hydra overrides look like key=value, +key=value or ~key)")
    return args, overrides
