"""cli_flags: both spellings of an option are one option, with one help text."""

import argparse

import pytest

from slimckpt.cli_flags import Formatter, flag, spellings


def test_both_spellings_are_one_option():
    p = argparse.ArgumentParser(prog="x", formatter_class=Formatter)
    flag(p, "--max_shard_size", metavar="SIZE", help="a size")
    flag(p, "--verbose", "-v", action="store_true", help="say more")
    assert p.parse_args(["--max_shard_size", "5GB"]).max_shard_size == "5GB"
    assert p.parse_args(["--max-shard-size", "1GB", "-v"]) == argparse.Namespace(max_shard_size="1GB", verbose=True)
    text = p.format_help()
    assert "--max-shard-size, --max_shard_size SIZE" in text and "--verbose, -v" in text
    assert spellings("--json") == ["--json"] and spellings("-cn") == ["-cn"]
    with pytest.raises(ValueError, match="help text"):
        flag(p, "--quiet", action="store_true")
