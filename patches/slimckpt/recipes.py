"""`python -m slimckpt.recipes`: slimckpt's Hydra config groups (recipes and overrides), one line
each (the code is in `slimckpt.verl.recipes`, next to the rest of what slimckpt knows of verl's config)."""

from .verl.recipes import main

if __name__ == "__main__":
    from slimckpt.log import cli_logging

    with cli_logging():
        raise SystemExit(main())
