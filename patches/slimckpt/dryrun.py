"""`python -m slimckpt.dryrun <hydra overrides...>`: the dry run's command (its code is in
`slimckpt.verl.dryrun`, next to the rest of what slimckpt knows of verl's config)."""

from .verl.dryrun import main

if __name__ == "__main__":
    from slimckpt.log import cli_logging

    with cli_logging():
        raise SystemExit(main())
