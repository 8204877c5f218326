"""merge/cli: `slimckpt merge --help` names every option, and a bad one is one line, exit 1 (every
subcommand's parser: tests/house/test_cli.py)."""

from __future__ import annotations

import pytest

from slimckpt import cli

from ..helpers.merge_cli import (
    error_line,
    log_lines,
    merge_cli,
)

slim_log = pytest.fixture(autouse=True, name="slim_log")(log_lines)


def test_cli_help_and_bad_options(capsys):
    with pytest.raises(SystemExit) as exc:
        cli.main(["merge", "--help"])
    assert exc.value.code == 0
    out = capsys.readouterr().out
    for flag in (
        "--local_dir",
        "--target_dir",
        "--dtype",
        "--max_shard_size",
        "--workers",
        "--distributed_merge",
        "--overwrite",
        "--merge_lora",
    ):
        assert flag in out
    assert cli.main([]) == 2
    rc, err = merge_cli(capsys, "--local_dir", "x", "--target_dir", "y", "--max_shard_size", "5G")
    assert rc == 1 and "--max_shard_size" in error_line(err)
