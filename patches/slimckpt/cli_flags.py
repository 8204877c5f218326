"""One convention for every command's options: a long option is accepted with hyphens and with
underscores (`--max-shard-size` and `--max_shard_size` are one option, one `dest`), since verl's own
tools spell theirs with underscores and most others with hyphens, and a user types whichever they saw
last. `--help` lists the hyphen form first and the other beside it, with the value's name once.

Every parser slimckpt builds adds its options through `flag` and formats its help with `Formatter`;
`tests/house/test_cli.py` walks each command's parser for both spellings and a help text on each.
"""

from __future__ import annotations

import argparse
from typing import Any

Adder = argparse.ArgumentParser | argparse._ArgumentGroup


def spellings(name: str) -> list[str]:
    """`--max_shard_size` -> ['--max-shard-size', '--max_shard_size']; a short or one-word option
    (`-v`, `--json`) has one spelling."""
    if not name.startswith("--"):
        return [name]
    word = name[2:]
    hyphen, underscore = "--" + word.replace("_", "-"), "--" + word.replace("-", "_")
    return [hyphen] if hyphen == underscore else [hyphen, underscore]


def flag(p: Adder, *names: str, **kwargs: Any) -> argparse.Action:
    """`p.add_argument` with each long name in both spellings and one `dest` (the underscore form of
    the first long name). Every option has a help text: one without is a mistake caught here."""
    if not kwargs.get("help"):
        raise ValueError(f"{names[0]}: give the option a help text")
    options = [s for n in names for s in spellings(n)]
    longs = [n for n in names if n.startswith("--")]
    if longs and "dest" not in kwargs:
        kwargs["dest"] = longs[0][2:].replace("-", "_")
    return p.add_argument(*options, **kwargs)


class Formatter(argparse.HelpFormatter):
    """`--max-shard-size, --max_shard_size SIZE` instead of the value's name after each spelling."""

    def _format_action_invocation(self, action: argparse.Action) -> str:
        if not action.option_strings or action.nargs == 0:
            return super()._format_action_invocation(action)
        value = self._format_args(action, self._get_default_metavar_for_optional(action))
        return f"{', '.join(action.option_strings)} {value}"


class RawFormatter(Formatter, argparse.RawDescriptionHelpFormatter):
    """The same, keeping a description's and epilog's own line breaks (examples)."""
