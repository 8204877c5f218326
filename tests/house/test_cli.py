"""The `slimckpt` command's conventions (slimckpt.cli, slimckpt.cli_flags): `--help` of the command
and of each subcommand answers without importing torch, transformers or verl, and says nothing on
stderr; every long option takes both spellings (`--max-shard-size` and `--max_shard_size`), one
`dest`; every option and argument has a help text."""

import argparse
import importlib
import json
import subprocess
import sys

import pytest

from slimckpt.cli import OWN_PARSER, SUBCOMMANDS, build_parser
from slimckpt.cli_flags import Formatter, flag, spellings

from ..conftest import REPO

HEAVY = ("torch", "transformers", "verl")
HELP_RUN = (
    "import json, sys\n"
    "from slimckpt.cli import main\n"
    "try:\n"
    "    main(sys.argv[1:])\n"
    "except SystemExit:\n"
    "    pass\n"
    f"print(json.dumps(sorted(m for m in {HEAVY!r} if m in sys.modules)))\n"
)


@pytest.mark.parametrize("argv", [["--help"]] + [[name, "--help"] for name in SUBCOMMANDS])
def test_help_loads_no_torch_transformers_or_verl(argv):
    # one interpreter imports slimckpt's parsers and prints a help: well under a second; 120 s is a hang
    proc = subprocess.run(
        [sys.executable, "-c", HELP_RUN, *argv], capture_output=True, text=True, cwd=REPO, timeout=120
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    *help_text, loaded = proc.stdout.strip().splitlines()
    assert help_text and help_text[0].startswith("usage: slimckpt"), proc.stdout[:500]
    assert json.loads(loaded) == [], f"`slimckpt {' '.join(argv)}` imported {loaded}: import it in run()"
    assert proc.stderr == "", f"`slimckpt {' '.join(argv)}` printed on stderr (a log line?): {proc.stderr[:500]}"


def command_parsers() -> dict[str, argparse.ArgumentParser]:
    """Every parser a user meets: the command's, each subcommand's, `python -m slimckpt.plan`'s."""
    parsers = {"slimckpt": build_parser([])[0]}
    for name, module_name in SUBCOMMANDS.items():
        module = importlib.import_module(module_name)
        if name in OWN_PARSER:
            parsers[name] = module.build_parser()
        else:
            parsers[name] = argparse.ArgumentParser(prog=f"slimckpt {name}", formatter_class=Formatter)
            module.add_arguments(parsers[name])
    return parsers


def convention_breaks(parsers: dict[str, argparse.ArgumentParser]) -> list[str]:
    bad = []
    for name, parser in parsers.items():
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction):
                continue
            what = f"slimckpt {name} {'/'.join(action.option_strings) or action.dest}"
            if not (action.help or "").strip():
                bad.append(f"{what}: no help text")
            for option in action.option_strings:
                missing = [s for s in spellings(option) if s not in action.option_strings]
                if missing:
                    bad.append(f"{what}: {option} without {', '.join(missing)} (add it with cli_flags.flag)")
    return bad


def test_every_option_takes_both_spellings_and_has_help():
    parsers = command_parsers()
    assert set(parsers) == {"slimckpt", *SUBCOMMANDS}
    assert sum(len(p._actions) for p in parsers.values()) > 60  # the walk sees the options
    assert convention_breaks(parsers) == []


def test_the_walk_finds_a_lone_spelling_and_a_missing_help():
    p = argparse.ArgumentParser()
    p.add_argument("--world-size", help="ranks")
    p.add_argument("--json", action="store_true")
    flag(p, "--max_shard_size", help="a size")
    assert convention_breaks({"x": p}) == [
        "slimckpt x --world-size: --world-size without --world_size (add it with cli_flags.flag)",
        "slimckpt x --json: no help text",
    ]


@pytest.mark.parametrize(
    "argv, dest, value",
    [
        (["merge", "--local_dir", "a", "--target-dir", "b", "--max_shard_size", "5GB"], "max_shard_size", "5GB"),
        (["merge", "--local-dir", "a", "--target_dir", "b", "--max-shard-size", "5GB"], "max_shard_size", "5GB"),
        (["merge", "--local-dir", "a", "--target_dir", "b", "--distributed-merge"], "distributed_merge", True),
        (["convert", "s", "--to", "verl", "--world_size", "4"], "world_size", 4),
        (["plan", "--config", "c", "--world_size", "4", "--trust_remote_code"], "trust_remote_code", True),
        (["verify", "d", "--no-progress"], "no_progress", True),
    ],
)
def test_the_subcommands_take_either_spelling(argv, dest, value):
    parser, _ = build_parser(argv)
    assert getattr(parser.parse_args(argv), dest) == value
