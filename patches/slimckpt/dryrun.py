"""`python -m slimckpt.dryrun [--plan] <hydra overrides...>`: the dry run's command (its code is in
`slimckpt.verl.dryrun`, next to the rest of what slimckpt knows of verl's config); with --plan, once
the config passed, `slimckpt plan` for it (slimckpt.dryrun_plan)."""

from __future__ import annotations

import argparse

from . import dryrun_plan


def _after(args: argparse.Namespace, overrides: list[str]) -> int:
    if not getattr(args, "plan", False) or args.no_validate or args.show:
        return 0
    assumed = dryrun_plan.Assumptions(disk_gbps=args.disk_gbps, rollout_s=args.rollout_s, copy_gbps=args.copy_gbps,
                                      node_memory_gb=args.node_memory_gb)
    return dryrun_plan.run(overrides, assumed)


def main(argv: list[str] | None = None) -> int:
    from .verl.dryrun import main as verl_main

    return verl_main(argv, extend=dryrun_plan.add_arguments, after=_after)


if __name__ == "__main__":
    from slimckpt.log import cli_logging

    with cli_logging():
        raise SystemExit(main())
